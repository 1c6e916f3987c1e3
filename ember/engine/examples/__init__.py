"""Example models that need no hub: built or shipped locally."""
