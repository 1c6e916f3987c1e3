"""The values every layer shares, below all of them: what a version is (``spec``: the
resolved version a replica serves, its tier and priority vocabulary), what its artifact
holds (``manifest``: every file with size and sha256; ``safetensors``: the header format),
and which code a tenant may name (``trust``). It imports only ``ember.errors`` and
``ember.costmodel``, so the registry, the loader, the engine and the control plane can all
import it without importing each other."""
