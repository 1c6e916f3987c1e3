"""The data plane's protocols as wire formats (OIP v2's tensors in ``oip``, OpenAI's
request and response models in ``openai``): pure encoding and decoding, no FastAPI, so the
routes in ``ember.api.routes`` stay thin adapters between them and the gateway."""
