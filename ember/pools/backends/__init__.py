"""Replica backends: every process / Kubernetes side effect goes through one of these."""
