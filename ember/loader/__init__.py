"""Weights: object store (file://, s3://) -> NVMe cache -> device.

The control plane may import ``ember.domain.safetensors`` and ``ember.loader.stores``
(both torch-free); only the device placement modules import torch.
"""
