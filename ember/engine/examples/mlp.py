"""A tensor example model: a small MLP (the ``torch`` engine's example and bench model)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file


def mlp(
    in_features: int = 256, hidden: int = 1024, out_features: int = 16, layers: int = 3
) -> torch.nn.Module:
    blocks: list[torch.nn.Module] = []
    width = in_features
    for _ in range(layers - 1):
        blocks += [torch.nn.Linear(width, hidden), torch.nn.GELU()]
        width = hidden
    blocks.append(torch.nn.Linear(width, out_features))
    return torch.nn.Sequential(*blocks)


ENGINE_CONFIG = {"factory": "ember.engine.examples.mlp:mlp", "kwargs": {}}
INPUT_SCHEMA = {"shape": [256], "dtype": "float32"}


def build_mlp_artifact(path: Path, seed: int = 0, **kwargs: int) -> Path:
    """Write seeded MLP weights as safetensors; returns the path."""
    torch.manual_seed(seed)
    module = mlp(**kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path))
    return path


def build_mlp_directory(folder: Path, seed: int = 0, shards: int = 3, **kwargs: int) -> Path:
    """The MLP as a sharded checkpoint in the layout every large model ships in:
    ``model-0000i-of-0000n.safetensors`` shards and ``model.safetensors.index.json``, split
    the way ``save_pretrained`` splits (``huggingface_hub``'s splitter), plus a
    ``config.json``. Returns the directory."""
    import json

    from huggingface_hub import split_torch_state_dict_into_shards

    torch.manual_seed(seed)
    state = {k: v.contiguous() for k, v in mlp(**kwargs).state_dict().items()}
    total = sum(t.numel() * t.element_size() for t in state.values())
    split = split_torch_state_dict_into_shards(state, max_shard_size=max(1, total // shards))
    folder.mkdir(parents=True, exist_ok=True)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n] for n in names}, str(folder / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": total}, "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps({"model_type": "mlp", **kwargs}))
    return folder


class SlowMLP(torch.nn.Module):
    """The MLP plus a fixed delay per forward pass: makes queueing observable in tests
    (a real module with real weights; the sleep stands in for a bigger model)."""

    def __init__(self, delay_s: float = 0.2, **kwargs: int) -> None:
        super().__init__()
        self.inner = mlp(**kwargs)
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(self.delay_s)
        result: torch.Tensor = self.inner(x)
        return result


def slow_mlp(delay_s: float = 0.2, **kwargs: int) -> torch.nn.Module:
    return SlowMLP(delay_s, **kwargs)


def build_slow_mlp_artifact(path: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    module = slow_mlp()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path))
    return path
