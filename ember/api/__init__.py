"""The HTTP API: control routes (register, deploy) and, later, data-plane routes."""
