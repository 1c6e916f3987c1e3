"""The replica runtime: one process serves one model version (``ember engine``).

Engines (torch, transformers, vllm) sit behind the small ``Engine`` interface in
``base``; ``scheduler`` queues and batches requests by priority; ``server`` is the
replica's internal HTTP API. Only this package and ``ember.loader`` import torch.
"""
