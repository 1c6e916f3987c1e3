"""The web dashboard served by the API under ``/ui`` (``ember.api.ui.routes``)."""
