"""Ember: a serverless-style model platform that never scales a latency-critical model to zero."""

__version__ = "0.1.0"
