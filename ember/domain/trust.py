"""What code a model version may make a replica run (issue 20 §1). Torch-free.

A version names code in two places, and both are checked here: at registration (the
control API, before anything is stored or the artifact is read) and again in the replica
before it imports or starts anything (a version registered before these checks, or
under a wider setting, is refused at load with the reason).

- **torch factories** (``engine_config.factory``, ``package.module:callable``). Any
  tenant may name a factory matching ``EMBER_ENGINE_FACTORIES``; its callable must be a
  plain public name (no attribute path, no leading underscore) and, at load, defined in
  that module (not imported into it: ``pkg.models:os`` or ``pkg.models:system`` are
  refused even where ``pkg.models`` is allowed). A tenant an admin marks trusted may
  name any importable factory of the ``FACTORY_PATTERN`` form.
- **vLLM flags** (``engine_config.vllm_args``). Only the tuning flags in ``VLLM_ARGS``
  plus the operator's ``EMBER_VLLM_ARGS_ALLOWED`` (trusted tenants: any flag), each
  with a bounded scalar value; the flags Ember sets itself (``EMBER_VLLM_ARGS``: the
  model path, ``--load-format ember``, the worker extension, ...) never.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from ember.errors import InvalidInput

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
FACTORY_PATTERN = re.compile(rf"{_NAME}(?:\.{_NAME})*:{_NAME}(?:\.{_NAME})*")
"""The form of every factory reference (matched whole): ``package.module:callable``."""
PUBLIC_CALLABLE = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
"""The callable part of a factory an untrusted tenant names: one public name."""
DEFAULT_ENGINE_FACTORIES = ("ember.engine.examples.mlp:mlp", "ember.engine.examples.mlp:slow_mlp")
"""The default of ``EMBER_ENGINE_FACTORIES``: Ember's example model factories."""
KWARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
"""A factory keyword argument's name."""


def _refused(location: str, detail: str) -> InvalidInput:
    """A 422 problem naming what was refused, shaped like a validation problem."""
    return InvalidInput(
        detail, errors=[{"location": location, "message": detail, "type": "not_allowed"}]
    )


# --- torch factories ---------------------------------------------------------------------


def factory_allowed(factory: str, patterns: Iterable[str]) -> bool:
    """Whether ``factory`` matches one of ``patterns`` (``fnmatch``, case-sensitive): a
    pattern with a ``:`` is matched against the whole ``module:callable``, one without
    against the module path (``mycorp.models.*`` allows every module under it)."""
    module = factory.partition(":")[0]
    return any(fnmatchcase(factory if ":" in p else module, p) for p in patterns)


def check_factory(factory: object, patterns: Iterable[str], trusted: bool) -> str:
    """``factory`` if the tenant may name it, else a 422 naming it."""
    location = "engine_config.factory"
    if not isinstance(factory, str) or not FACTORY_PATTERN.fullmatch(factory):
        raise _refused(
            location, 'the torch engine needs engine_config.factory: "package.module:callable"'
        )
    if trusted:
        return factory
    callable_name = factory.partition(":")[2]
    if not PUBLIC_CALLABLE.fullmatch(callable_name):
        raise _refused(
            location,
            f"engine factory {factory!r} is not allowed: its callable must be one public "
            "name of the module (no attribute path, no leading underscore)",
        )
    if not factory_allowed(factory, patterns):
        raise _refused(
            location,
            f"engine factory {factory!r} is not allowed: only factories matching "
            "EMBER_ENGINE_FACTORIES may be named (an admin can mark the tenant trusted)",
        )
    return factory


def check_defined_in_module(factory: str, obj: object, trusted: bool) -> None:
    """At load, after the import: an untrusted factory must be a callable defined in the
    module it names, not something that module imported (``os.system``, ``Popen``)."""
    if trusted:
        return
    module = factory.partition(":")[0]
    if not callable(obj) or getattr(obj, "__module__", None) != module:
        raise _refused(
            "engine_config.factory",
            f"engine factory {factory!r} is not allowed: it is not a callable defined in "
            f"module {module!r}",
        )


def check_factory_kwargs(kwargs: object) -> dict[str, Any]:
    """A factory's ``kwargs``: a JSON object with identifier keys (plain JSON values;
    its size is bounded with the whole engine_config)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise _refused("engine_config.kwargs", "engine_config.kwargs must be a JSON object")
    for key in kwargs:
        if not isinstance(key, str) or not KWARG_NAME.fullmatch(key):
            raise _refused(
                "engine_config.kwargs",
                f"engine_config.kwargs key {str(key)[:64]!r} is not a keyword argument name",
            )
    _check_plain_json(kwargs, "engine_config.kwargs", depth=0)
    return dict(kwargs)


def _check_plain_json(value: object, location: str, depth: int) -> None:
    if depth > 32:
        raise _refused(location, f"{location} is nested too deeply")
    if value is None or isinstance(value, bool | int | str):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _refused(location, f"{location} holds a non-finite number")
        return
    if isinstance(value, list):
        for item in value:
            _check_plain_json(item, location, depth + 1)
        return
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        for item in value.values():
            _check_plain_json(item, location, depth + 1)
        return
    raise _refused(location, f"{location} must be plain JSON")


# --- vLLM flags ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ArgRule:
    """The values one ``vllm serve`` flag may take."""

    kind: str  # "bool" | "int" | "float" | "word" | "scalar"
    low: float = 0
    high: float = 0

    def check(self, key: str, value: object) -> None:
        location = f"engine_config.vllm_args.{key}"
        number = _number(value)
        if self.kind == "scalar":  # an operator-allowed flag: any bounded scalar
            if isinstance(value, bool) or _is_word(value):
                return
            if number is not None and abs(number) <= 2**53:
                return
            raise _refused(location, f"vllm_args {key!r} must be a boolean, number or word")
        if self.kind == "bool":
            if isinstance(value, bool):
                return
            raise _refused(location, f"vllm_args {key!r} must be true or false")
        if self.kind == "word":
            if _is_word(value):
                return
            raise _refused(
                location, f"vllm_args {key!r} must be a word (letters, digits, '._-'; 64 at most)"
            )
        if self.kind == "int" and not isinstance(value, int):
            number = None
        if number is not None and self.low <= number <= self.high:
            return
        what = "an integer" if self.kind == "int" else "a number"
        raise _refused(
            location, f"vllm_args {key!r} must be {what} in [{_num(self.low)}, {_num(self.high)}]"
        )


_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _is_word(value: object) -> bool:
    return isinstance(value, str) and _WORD.fullmatch(value) is not None


def _number(value: object) -> float | None:
    """A JSON number's value (not a boolean; an out-of-range integer is infinite),
    else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any bound
        return math.inf
    return number if math.isfinite(number) else None


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


_INT, _FLOAT, _BOOL, _WORD_RULE = "int", "float", "bool", "word"
VLLM_ARGS: dict[str, ArgRule] = {
    # scheduling and batching
    "max-num-batched-tokens": ArgRule(_INT, 1, 1 << 24),
    "long-prefill-token-threshold": ArgRule(_INT, 0, 1 << 24),
    "max-num-partial-prefills": ArgRule(_INT, 1, 1024),
    "max-long-partial-prefills": ArgRule(_INT, 1, 1024),
    "enable-chunked-prefill": ArgRule(_BOOL),
    "async-scheduling": ArgRule(_BOOL),
    # KV cache and memory
    "block-size": ArgRule(_INT, 1, 1024),
    "enable-prefix-caching": ArgRule(_BOOL),
    "gpu-memory-utilization": ArgRule(_FLOAT, 0.01, 0.98),
    "num-gpu-blocks-override": ArgRule(_INT, 1, 1 << 24),
    "cpu-offload-gb": ArgRule(_FLOAT, 0, 1024),
    "kv-cache-dtype": ArgRule(_WORD_RULE),
    "calculate-kv-scales": ArgRule(_BOOL),
    # model execution
    "quantization": ArgRule(_WORD_RULE),
    "seed": ArgRule(_INT, 0, 2**32 - 1),
    "tensor-parallel-size": ArgRule(_INT, 1, 64),
    "pipeline-parallel-size": ArgRule(_INT, 1, 64),
    "max-cudagraph-capture-size": ArgRule(_INT, 1, 8192),
    "disable-sliding-window": ArgRule(_BOOL),
    "disable-cascade-attn": ArgRule(_BOOL),
    "max-logprobs": ArgRule(_INT, 0, 1024),
    "disable-log-stats": ArgRule(_BOOL),
}
"""The ``vllm serve`` tuning flags any version may set, with the values each may take.
None reads files, names code or models, or reaches the network."""

EMBER_VLLM_ARGS: dict[str, str | None] = {
    "model": None,
    "served-model-name": None,
    "load-format": None,
    "model-loader-extra-config": None,
    "worker-extension-cls": None,
    "scheduling-policy": None,
    "generation-config": None,
    "enable-sleep-mode": None,
    "dtype": "dtype",
    "enforce-eager": "enforce_eager",
    "kv-cache-memory-bytes": "kv_cache_bytes",
    "max-model-len": "max_model_len",
    "max-num-seqs": "max_num_seqs",
}
"""The flags Ember sets itself (never from ``vllm_args``, whoever asks), with the
``engine_config`` field that sets it where there is one."""
_ARG_NAME = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")


def vllm_flag(key: str) -> str:
    """A ``vllm_args`` key as vLLM's parser reads it (``max_num_seqs`` = ``max-num-seqs``)."""
    return key.replace("_", "-")


def check_vllm_args(args: object, allowed: Iterable[str] = (), trusted: bool = False) -> None:
    """Every ``vllm_args`` flag allowlisted (``VLLM_ARGS`` or ``allowed``; a trusted tenant:
    any but Ember's own) with a bounded scalar value; else a 422 naming the key."""
    if not isinstance(args, Mapping):
        raise _refused("engine_config.vllm_args", "engine_config.vllm_args must be a JSON object")
    extra = {vllm_flag(k) for k in allowed}
    for key, value in args.items():
        flag = vllm_flag(str(key))
        location = f"engine_config.vllm_args.{str(key)[:80]}"
        if not _ARG_NAME.fullmatch(flag) or len(flag) > 80:
            raise _refused(
                location, f"vllm_args key {str(key)[:80]!r} is not a flag name (no dashes)"
            )
        if flag in EMBER_VLLM_ARGS:
            field = EMBER_VLLM_ARGS[flag]
            hint = f"; set engine_config.{field}" if field else ""
            raise _refused(location, f"vllm_args {key!r} is set by Ember and cannot be given{hint}")
        rule = VLLM_ARGS.get(flag)
        if rule is None:
            if not (trusted or flag in extra):
                raise _refused(
                    location,
                    f"vllm_args {key!r} is not allowed: only vLLM's tuning flags (and "
                    "EMBER_VLLM_ARGS_ALLOWED) may be set",
                )
            rule = ArgRule("scalar")
        rule.check(str(key), value)


# --- one version -------------------------------------------------------------------------


def check_version_code(
    engine: str,
    config: Mapping[str, Any],
    factories: Iterable[str],
    vllm_args_allowed: Iterable[str] = (),
    trusted: bool = False,
) -> None:
    """The registration check: the code ``config`` names (a torch factory, vLLM flags)
    is allowed for a tenant (``trusted`` or not), else a 422 problem naming it. Reads
    nothing, imports nothing."""
    if engine == "torch":
        check_factory(config.get("factory"), factories, trusted)
        check_factory_kwargs(config.get("kwargs"))
    elif engine == "vllm":
        check_vllm_args(config.get("vllm_args") or {}, vllm_args_allowed, trusted)
