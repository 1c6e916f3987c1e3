"""The torch and transformers engines on the device, in process: each loads a version
through the loader onto the device (a single file, and a sharded directory version the
way large models ship) and answers as the same engine on the CPU does; and a replica's
tier changes — hot → warm → hot (weights to host memory and back: one host-to-device
copy) and hot → standby → hot (weights dropped, then loaded again from the NVMe cache) —
each timed, with the device memory given back while warm or standby and the same answers
after. The timings are figures of ``make gpu-check`` (``record_property``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file as st_load

from ember.config import Settings
from ember.domain.spec import Tier, VersionSpec
from ember.engine.examples.mlp import INPUT_SCHEMA, build_mlp_artifact, mlp
from ember.engine.torch_engine import TorchEngine
from ember.errors import InvalidInput
from ember.registry import validation
from tests.gpu.cuda import (
    DEVICE,
    ON_CUDA,
    device_bytes,
    module_bytes,
    needs_device,
    on_device,
    timed,
)

pytestmark = needs_device
Record = Callable[[str, object], None]
FACTORY = "ember.engine.examples.mlp:mlp"
BIG = {"hidden": 4096, "layers": 6}
"""~270 MB of fp32 weights: tier changes long enough to time."""


def spec_of(uri: str, settings: Settings, model: str, engine: str, **extra: Any) -> VersionSpec:
    """The spec the pools controller sends, from what registration records."""
    facts = validation.inspect_artifact(uri, settings, None)
    return VersionSpec(model=model, version="1", artifact_uri=uri, sha256=facts.sha256,
                       files=facts.files, engine=engine, **extra)  # fmt: skip


def mlp_spec(settings: Settings, model: str, sharded: bool, **kwargs: int) -> VersionSpec:
    folder = settings.data_dir / "objects" / model / "1"
    config = {"factory": FACTORY, "kwargs": kwargs}
    if sharded:
        from ember.engine.examples.mlp import build_mlp_directory

        build_mlp_directory(folder, shards=4, **kwargs)
        assert len(list(folder.glob("*.safetensors"))) >= 2
        uri = folder.as_uri() + "/"
    else:
        uri = build_mlp_artifact(folder / "model.safetensors", **kwargs).as_uri()
    return spec_of(uri, settings, model, "torch", engine_config=config, input_schema=INPUT_SCHEMA)


def reference_mlp(spec: VersionSpec, **kwargs: int) -> torch.nn.Module:
    """The same weights in a module on the CPU, loaded by safetensors."""
    module = mlp(**kwargs)
    root = Path(spec.artifact_uri.removeprefix("file://"))
    files = sorted(root.glob("*.safetensors")) if spec.directory else [root]
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state |= st_load(str(f))
    module.load_state_dict(state)
    return module.eval()


def instances(n: int = 8) -> list[list[float]]:
    rng = np.random.default_rng(5)
    rows: list[list[float]] = rng.standard_normal((n, 256)).astype(np.float32).tolist()
    assert INPUT_SCHEMA["shape"] == [256]
    return rows


def answer(engine: Any, batch: list[Any]) -> Any:
    return engine.forward([engine.prepare(x).value for x in batch])


def weights_of(engine: TorchEngine) -> Any:
    return engine.module


def assert_params_on(module: torch.nn.Module, device: torch.device | str) -> None:
    want = torch.device(device)
    for name, t in module.state_dict().items():
        ok = on_device(t) if want == DEVICE else t.device.type == want.type
        assert ok, f"{name} is on {t.device}, not {want}"


@pytest.mark.parametrize("sharded", [False, True], ids=["single-file", "sharded"])
def test_the_torch_engine_serves_from_the_device(settings: Settings, sharded: bool) -> None:
    spec = mlp_spec(settings, "mlp-sharded" if sharded else "mlp", sharded)
    engine = TorchEngine(spec, settings, device=str(DEVICE))
    engine.load()
    try:
        assert engine.tier is Tier.hot and engine.load_report.tensors == 6
        assert_params_on(engine.module, DEVICE)
        batch = instances()
        with torch.inference_mode():
            want = reference_mlp(spec)(torch.tensor(batch)).numpy()
        np.testing.assert_allclose(np.array(answer(engine, batch)), want, rtol=1e-4, atol=1e-4)
    finally:
        engine.close()


def test_tier_changes_on_the_device_are_timed(settings: Settings, record_property: Record) -> None:
    spec = mlp_spec(settings, "mlp-big", False, **BIG)
    engine = TorchEngine(spec, settings, device=str(DEVICE))
    try:
        with timed(record_property, "tier_standby_to_hot_first_s"):
            engine.load()  # a miss: the store fills the cache while the device fills
        batch = instances()
        hot_answer = answer(engine, batch)
        weights = module_bytes(engine.module)
        hot_bytes = device_bytes()
        record_property("tier_weights_bytes", weights)

        with timed(record_property, "tier_hot_to_warm_s"):
            engine.set_tier(Tier.warm)
        assert engine.tier is Tier.warm
        with pytest.raises(InvalidInput, match="warm"):
            answer(engine, batch)
        if ON_CUDA:  # weights in host memory (pinned), the device's memory given back
            assert_params_on(engine.module, "cpu")
            assert all(t.is_pinned() for t in engine.module.state_dict().values())
            assert device_bytes() <= hot_bytes - 0.9 * weights
        with timed(record_property, "tier_warm_to_hot_s"):
            engine.set_tier(Tier.hot)
        assert_params_on(engine.module, DEVICE)
        np.testing.assert_allclose(answer(engine, batch), hot_answer, rtol=1e-6, atol=1e-6)

        with timed(record_property, "tier_hot_to_standby_s"):
            engine.set_tier(Tier.standby)
        assert engine.tier.value == "standby" and weights_of(engine) is None
        if ON_CUDA:
            assert device_bytes() <= hot_bytes - 0.9 * weights
        with timed(record_property, "tier_standby_to_hot_s"):
            engine.set_tier(Tier.hot)  # from the NVMe cache this time
        assert engine.load_report.cache in ("hit", "verified-hit")
        assert_params_on(engine.module, DEVICE)
        np.testing.assert_allclose(answer(engine, batch), hot_answer, rtol=1e-6, atol=1e-6)
    finally:
        engine.close()


# --- transformers --------------------------------------------------------------------------
TEXTS = ["the quick brown fox", "every replica serves weights from its cache on the device",
         "a lazy dog", "requests wait while the fox jumps over the dog " * 4]  # fmt: skip
WORDS = sorted({word for text in TEXTS for word in text.split()})


def write_tiny_bert(folder: Path) -> None:
    """A 2-layer BERT with random weights and a word-level vocabulary, written by
    ``save_pretrained`` in four shards with their index: no hub, no download."""
    import transformers

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *dict.fromkeys(WORDS)]
    folder.mkdir(parents=True)
    if int(transformers.__version__.split(".")[0]) >= 5:
        tokenizer = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    else:  # 4.x: the fast tokenizer from a vocab file
        (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
        fast = transformers.BertTokenizerFast  # type: ignore[attr-defined]
        tokenizer = fast(vocab_file=str(folder / "vocab.txt"))
    tokenizer.save_pretrained(folder)
    config = transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(folder, max_shard_size="100KB")


def test_the_transformers_engine_serves_a_sharded_version_from_the_device(
    settings: Settings,
) -> None:
    from ember.engine.transformers_engine import TransformersEngine

    folder = settings.data_dir / "objects" / "tiny-bert" / "1"
    write_tiny_bert(folder)
    assert len(list(folder.glob("*.safetensors"))) >= 3
    spec = spec_of(folder.as_uri() + "/", settings, "tiny-bert", "transformers",
                   engine_config={"task": "embedding", "max_length": 32})  # fmt: skip
    on_gpu = TransformersEngine(spec, settings, device=str(DEVICE))
    on_cpu = TransformersEngine(spec, settings, device="cpu")
    on_gpu.load()
    on_cpu.load()
    try:
        assert_params_on(on_gpu.module, DEVICE)
        got, want = np.array(answer(on_gpu, TEXTS)), np.array(answer(on_cpu, TEXTS))
        assert got.shape == (len(TEXTS), 64)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    finally:
        on_gpu.close()
        on_cpu.close()
