"""``vllm`` engine: vLLM's own engine for LLM artifacts, with the OpenAI routes.

vLLM batches continuously on its own, so the OpenAI-compatible routes this engine
mounts (``routes()``: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions``, streaming included) go straight to vLLM's serving layer
and not through Ember's batcher. ``X-Ember-Priority: online|async|batch`` maps onto
vLLM's priority scheduling (lower is served first: health 0 < online 1 < async 2 <
batch 3). ``/infer`` works too: an instance is a prompt string or
``{"prompt": ..., "max_tokens": ..., "temperature": ...}``, the output is the text with
its token counts. Every generation is counted (tokens in and out, per priority) for
model units.

Weights come through Ember's loader: vLLM loads with ``--load-format ember``
(``ember.engine.vllm_plugin``), which streams the verified cache file into the model in
vLLM's worker process. The sidecar files (config, tokenizer, generation config) are
the version's own, verified (``ember.engine.sidecars``): a directory version's from its
manifest, a single-file version's from beside the weights, checked against their sha256.

engine_config (all optional)::

    {"max_model_len": 512, "dtype": "float32", "kv_cache_bytes": 67108864,
     "enforce_eager": true, "max_num_seqs": 64, "max_tokens": 16,
     "vllm_args": {"max-num-batched-tokens": 2048}}

``vllm_args`` takes vLLM's tuning flags only (``ember.domain.trust.VLLM_ARGS``, plus
``EMBER_VLLM_ARGS_ALLOWED``; a trusted tenant any), never the flags Ember sets (the
model path, ``--load-format ember``, the worker extension, ...): checked at registration
and again here, before vLLM starts.

Tiers: on CUDA, warm is vLLM sleep mode level 1 (weights to host RAM, KV cache
dropped) and hot is ``wake_up``; on CPU warm only flags the tier (the weights already
are in host RAM). Standby shuts the vLLM engine down; promoting loads it again.

Imported only where vLLM is installed (``.venv-vllm``); vLLM itself is imported lazily.
Run one replica with ``.venv-vllm/bin/ember engine --spec-file F --port P``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ember.config import Settings
from ember.domain.spec import Priority, Tier, VersionSpec, VllmOptions
from ember.domain.trust import check_vllm_args, vllm_flag
from ember.engine.base import Engine, Sized, register_engine
from ember.engine.sidecars import fetch_sidecars
from ember.errors import EngineError, InvalidInput, NotReady
from ember.loader.report import LoadReport, Stage
from ember.logs import get_logger, model_context

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = get_logger(__name__)

REQUIRED_SIDECARS = ("config.json", "tokenizer_config.json")
PRIORITY_HEADER = "x-ember-priority"
PROBE_PROMPT = "ok"
# Environment vLLM reads at import or process start; operators' own values win.
VLLM_ENV_DEFAULTS = {
    "VLLM_HOST_IP": "127.0.0.1",  # else vLLM binds its internal sockets on eth0
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",  # weights and sidecars come from Ember, never a hub
    "VLLM_CONFIGURE_LOGGING": "0",  # vLLM's lines go through Ember's handler
}


class InferInstance(BaseModel):
    """One ``/infer`` instance."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0, le=2)
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class _Prepared:
    instance: InferInstance
    token_ids: list[int]
    priority: Priority


# --- the artifact's files ------------------------------------------------------------


def vllm_argv(
    spec: VersionSpec,
    opts: VllmOptions,
    files: Path,
    device: str,
    extra: str,
    allowed: Iterable[str] = (),
) -> list[str]:
    """The ``vllm serve`` arguments for one version (parsed by vLLM's own parser): Ember's
    own, then ``vllm_args`` — each allowlisted (``ember.domain.trust``; ``allowed``: the
    operator's ``EMBER_VLLM_ARGS_ALLOWED``), none of Ember's own, as ``--flag=value``."""
    check_vllm_args(opts.vllm_args, allowed, spec.trusted)
    on_cpu = device == "cpu"
    args: dict[str, Any] = {
        "model": str(files),
        "served-model-name": [spec.model, f"{spec.model}:{spec.version}"],
        "load-format": "ember",
        "model-loader-extra-config": extra,
        "worker-extension-cls": "ember.engine.vllm_plugin.EmberWorkerExtension",
        "scheduling-policy": "priority",
        "dtype": opts.dtype or ("float32" if on_cpu else "auto"),
        "enforce-eager": opts.enforce_eager if opts.enforce_eager is not None else on_cpu,
        "kv-cache-memory-bytes": opts.kv_cache_bytes or (256 * 1024**2 if on_cpu else None),
        "max-model-len": opts.max_model_len,
        "max-num-seqs": opts.max_num_seqs,
        "enable-sleep-mode": device.startswith("cuda"),
        "generation-config": "auto",
    }
    argv: list[str] = []
    for key, value in args.items():
        if value is None or value is False:
            continue
        argv.append(f"--{key}")
        if isinstance(value, list):
            argv.extend(str(v) for v in value)
        elif value is not True:
            argv.append(str(value))
    for key, value in opts.vllm_args.items():
        flag = vllm_flag(key)
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            argv.append(f"--{flag}={value}")
    return argv


# --- token accounting ----------------------------------------------------------------


class TokenUsage:
    """Tokens in and out per priority class, for model units and ``/metrics``."""

    def __init__(self, spec: VersionSpec) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry: CollectorRegistry = CollectorRegistry()
        self.labels = {"model": spec.model, "version": spec.version}
        self.cost = spec.cost_model
        names = ["model", "version", "priority"]
        self.tokens = Counter("ember_llm_tokens", "LLM tokens", [*names, "direction"],
                              registry=self.registry)  # fmt: skip
        self.requests = Counter("ember_llm_requests", "LLM generations finished", names,
                                registry=self.registry)  # fmt: skip
        self.inflight = Gauge("ember_llm_inflight_units", "Model units of running generations",
                              ["model", "version"], registry=self.registry)  # fmt: skip
        self.inflight_units = 0.0

    def start(self, prompt_tokens: int, max_tokens: int) -> float:
        units = self.cost.cost(prompt_tokens, max_tokens)
        self._move(units)
        return units

    def finish(self, priority: int, units: float, prompt_tokens: int, output_tokens: int) -> None:
        self._move(-units)
        label = _priority_label(priority)
        self.tokens.labels(**self.labels, priority=label, direction="in").inc(prompt_tokens)
        self.tokens.labels(**self.labels, priority=label, direction="out").inc(output_tokens)
        self.requests.labels(**self.labels, priority=label).inc()

    def _move(self, units: float) -> None:
        self.inflight_units = max(0.0, self.inflight_units + units)
        self.inflight.labels(**self.labels).set(self.inflight_units)


def _priority_label(priority: int) -> str:
    try:
        return Priority(priority).label
    except ValueError:
        return str(priority)


def _counting_llm_class(usage: TokenUsage) -> Any:
    """``AsyncLLM`` that counts every generation's tokens (whoever calls it)."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    class CountingAsyncLLM(AsyncLLM):  # type: ignore[misc]
        async def generate(self, prompt: Any, sampling_params: Any, request_id: str,
                           **kwargs: Any) -> AsyncIterator[Any]:  # fmt: skip
            priority = int(kwargs.get("priority", 0))
            delta = sampling_params.output_kind == RequestOutputKind.DELTA
            prompt_n = out_n = 0
            units = 0.0
            started = False
            try:
                async for out in super().generate(prompt, sampling_params, request_id, **kwargs):
                    if not started:
                        prompt_n = len(out.prompt_token_ids or ())
                        units = usage.start(prompt_n, sampling_params.max_tokens or 0)
                        started = True
                    n = sum(len(o.token_ids) for o in out.outputs)
                    out_n = out_n + n if delta else n
                    yield out
            finally:
                if started:
                    usage.finish(priority, units, prompt_n, out_n)

    return CountingAsyncLLM


# --- the engine ----------------------------------------------------------------------


@register_engine("vllm")
class VllmEngine(Engine):
    """One vLLM engine (AsyncLLM with its engine-core process) for one version."""

    def __init__(self, spec: VersionSpec, settings: Settings, device: str = "cpu") -> None:
        super().__init__(spec, settings, device)
        try:
            self.options = VllmOptions.model_validate(spec.engine_config)
        except ValidationError as exc:
            raise InvalidInput(f"invalid vllm engine_config: {exc}") from exc
        check_vllm_args(self.options.vllm_args, settings.vllm_args_allowed, spec.trusted)
        self.usage = TokenUsage(spec)
        self.files: Path | None = None
        self.tokenizer: Any = None
        self.max_model_len = 0
        self._llm: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._serving: Any = None
        self._serving_lock: asyncio.Lock | None = None
        self._probe = InferInstance(prompt=PROBE_PROMPT, max_tokens=1)

    # --- lifecycle ---

    def load(self) -> None:
        with model_context(self.spec.model, self.spec.version):
            started = time.perf_counter()
            self._set_env()
            self.files = fetch_sidecars(self.spec, self.settings, REQUIRED_SIDECARS)
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(self.files), trust_remote_code=False)
            self._llm = self._start_vllm(self.files)
            self.max_model_len = int(self._llm.model_config.max_model_len)
            self._serving = None
            self.tier = Tier.hot
            log.info("vllm engine ready", seconds=round(time.perf_counter() - started, 2),
                     max_model_len=self.max_model_len, device=self.device)  # fmt: skip

    def _set_env(self) -> None:
        from ember.engine.vllm_plugin import LOG_CONTEXT_ENV, log_context_env

        for key, value in VLLM_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        if self.device.startswith("cuda:"):
            os.environ.setdefault("CUDA_VISIBLE_DEVICES", self.device.split(":", 1)[1])
        fields = {"model": self.spec.model, "version": self.spec.version, "process": "vllm"}
        os.environ[LOG_CONTEXT_ENV] = log_context_env(self.settings, **fields)

    def _start_vllm(self, files: Path) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.usage.usage_lib import UsageContext
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        from ember.engine.vllm_plugin import LoadTarget, loader_settings_dict

        report_path = files / f".load-report.{os.getpid()}.json"
        report_path.unlink(missing_ok=True)
        target = LoadTarget(model=self.spec.model, version=self.spec.version,
                            artifact_uri=self.spec.artifact_uri, sha256=self.spec.sha256,
                            files=self.spec.files,
                            settings=loader_settings_dict(self.settings),
                            report_path=str(report_path))  # fmt: skip
        argv = vllm_argv(self.spec, self.options, files, self.device, target.model_dump_json(),
                         self.settings.vllm_args_allowed)  # fmt: skip
        self.cli_args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        validate_parsed_serve_args(self.cli_args)
        engine_args = AsyncEngineArgs.from_cli_args(self.cli_args)
        usage = UsageContext.OPENAI_API_SERVER
        vllm_config = engine_args.create_engine_config(usage_context=usage)
        llm = _counting_llm_class(self.usage).from_vllm_config(
            vllm_config=vllm_config, usage_context=usage,
            enable_log_requests=engine_args.enable_log_requests,
            disable_log_stats=engine_args.disable_log_stats,
        )  # fmt: skip
        self.load_report = _read_report(report_path)
        return llm

    def set_tier(self, tier: Tier) -> None:
        if tier is self.tier:
            return
        sleeps = self._llm is not None and self.device.startswith("cuda")
        if sleeps and Tier.standby not in (tier, self.tier):
            # Sleep level 1: weights to host RAM, KV cache dropped; wake_up brings both back.
            coro = self._llm.sleep(level=1) if tier is Tier.warm else self._llm.wake_up()
            self._run_on_loop(coro)
            self.tier = tier
            return
        super().set_tier(tier)  # CPU: warm = flag only (weights are in RAM); standby = shut down

    def unload(self) -> None:
        llm, self._llm, self._serving = self._llm, None, None
        if llm is not None:
            with model_context(self.spec.model, self.spec.version):
                llm.shutdown()
                log.info("vllm engine shut down")

    # --- /infer ---

    def prepare(self, instance: Any) -> Sized:
        self._remember_loop()
        is_probe = instance is self._probe
        if isinstance(instance, str):
            instance = {"prompt": instance}
        try:
            parsed = InferInstance.model_validate(instance)
        except ValidationError as exc:
            raise InvalidInput(
                'each instance must be a prompt string or {"prompt": ..., "max_tokens": ...}: '
                f"{exc.errors(include_url=False)[:1]}"
            ) from None
        if self.tokenizer is None:
            raise NotReady("the vllm engine is not loaded", tier=self.tier.value)
        ids = list(self.tokenizer(parsed.prompt)["input_ids"])
        max_tokens = parsed.max_tokens or self.options.max_tokens
        if self.max_model_len and len(ids) + max_tokens > self.max_model_len:
            raise InvalidInput(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"context of {self.max_model_len} tokens"
            )
        priority = Priority.health if is_probe else Priority.online
        return Sized(_Prepared(parsed, ids, priority), len(ids), max_tokens)

    def forward(self, batch: Sequence[Any]) -> list[Any]:
        return list(self._run_on_loop(self._generate_all(batch)))

    async def aforward(self, batch: Sequence[Any]) -> list[Any]:
        """``forward`` for a scheduler that awaits on the event loop: vLLM batches
        continuously, so batches need not wait for each other (nor probes for them)."""
        self._remember_loop()
        return await self._generate_all(batch)

    def probe(self) -> Any:
        return self._probe

    async def _generate_all(self, batch: Sequence[_Prepared]) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(self._generate_one(p) for p in batch)))

    async def _generate_one(self, prepared: _Prepared) -> dict[str, Any]:
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        llm = self._require_hot()
        inst = prepared.instance
        params = SamplingParams(max_tokens=inst.max_tokens or self.options.max_tokens,
                                temperature=inst.temperature, seed=inst.seed,
                                output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
        final = None
        async for out in llm.generate({"prompt_token_ids": prepared.token_ids}, params,
                                      f"infer-{uuid.uuid4().hex}",
                                      priority=int(prepared.priority)):  # fmt: skip
            final = out
        if final is None or not final.outputs:
            raise EngineError("vLLM returned no output")
        choice = final.outputs[0]
        return {"text": choice.text, "finish_reason": choice.finish_reason,
                "prompt_tokens": len(prepared.token_ids),
                "completion_tokens": len(choice.token_ids)}  # fmt: skip

    # --- event loop ---

    def _remember_loop(self) -> None:
        """vLLM's client lives on the server's event loop (its output task starts on the
        first request there); calls from other threads are handed to that loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._loop is not loop:
            self._loop, self._serving_lock = loop, asyncio.Lock()

    def _run_on_loop(self, coro: Awaitable[Any]) -> Any:
        if self._loop is None or self._loop.is_closed():
            _close(coro)
            raise EngineError("the vllm engine has not seen the server's event loop yet")
        return asyncio.run_coroutine_threadsafe(_awaited(coro), self._loop).result()

    def _require_hot(self) -> Any:
        if self._llm is None or self.tier is not Tier.hot:
            raise NotReady(f"replica is {self.tier.value}; promote it to hot first",
                           tier=self.tier.value)  # fmt: skip
        if self._llm.errored:
            raise EngineError("the vLLM engine died; this replica must be replaced")
        return self._llm

    # --- OpenAI routes ---

    def routes(self) -> APIRouter:
        """``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (vLLM's serving
        layer over this engine). Call it on the server's event loop, after ``load``."""
        self._remember_loop()
        if self._loop is not None:  # build vLLM's serving state now, not on the first call
            self._loop.create_task(self.serving())
        return openai_router(self)

    async def serving(self) -> Any:
        """vLLM's OpenAI serving objects over this engine (built once per load)."""
        self._remember_loop()
        llm = self._require_hot()
        assert self._serving_lock is not None
        async with self._serving_lock:
            if self._serving is None:
                from starlette.datastructures import State
                from vllm.entrypoints.launchers.api_server.app_state import init_app_state

                state = State()
                tasks = await llm.get_supported_tasks()
                with model_context(self.spec.model, self.spec.version):
                    await init_app_state(llm, state, self.cli_args, tasks)
                self._serving = state
        return self._serving

    def metrics_text(self) -> bytes:
        """Token counters of this engine plus vLLM's own metrics (``vllm:*``)."""
        from prometheus_client import REGISTRY, generate_latest

        return generate_latest(self.usage.registry) + generate_latest(REGISTRY)


# --- OpenAI routes ---------------------------------------------------------------------


def openai_router(engine: VllmEngine) -> APIRouter:
    """The OpenAI routes, each a thin call into vLLM's serving objects."""
    router = APIRouter()

    @router.get("/v1/models")
    async def models(raw_request: Request) -> Response:
        serving = await _serving_or_error(engine)
        if isinstance(serving, Response):
            return serving
        listed = await serving.openai_serving_models.show_available_models()
        return JSONResponse(listed.model_dump())

    @router.post("/v1/completions")
    async def completions(raw_request: Request) -> Response:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        return await _generate(engine, raw_request, CompletionRequest,
                               lambda s: s.openai_serving_completion.create_completion)  # fmt: skip

    @router.post("/v1/chat/completions")
    async def chat(raw_request: Request) -> Response:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return await _generate(engine, raw_request, ChatCompletionRequest,
                               lambda s: s.openai_serving_chat.create_chat_completion)  # fmt: skip

    return router


async def _serving_or_error(engine: VllmEngine) -> Any:
    try:
        return await engine.serving()
    except NotReady as exc:
        return openai_error(503, exc.detail, "ServiceUnavailableError")
    except EngineError as exc:
        return openai_error(500, exc.detail, "InternalServerError")


async def _generate(
    engine: VllmEngine, raw_request: Request, request_type: type[Any],
    handler_of: Callable[[Any], Callable[[Any, Request], Awaitable[Any]]],
) -> Response:  # fmt: skip
    """Parse, set the priority from ``X-Ember-Priority``, run vLLM's handler (cancelled
    when the client goes away) and shape its answer: JSON, SSE stream or error."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.entrypoints.serve.utils.api_utils import with_cancellation
    from vllm.exceptions import VLLMError

    try:
        priority = vllm_priority(raw_request.headers.get(PRIORITY_HEADER))
        body = await raw_request.json()
        request = request_type.model_validate(body)
    except InvalidInput as exc:
        return openai_error(400, exc.detail)
    except ValidationError as exc:
        return openai_error(400, f"invalid request: {exc.errors(include_url=False)[:3]}")
    except ValueError as exc:  # not JSON
        return openai_error(400, f"the body is not JSON: {exc}")
    request.priority = priority
    serving = await _serving_or_error(engine)
    if isinstance(serving, Response):
        return serving
    handler = with_cancellation(handler_of(serving))
    try:
        result = await handler(request, raw_request)
    except (VLLMError, ValueError, TypeError, OverflowError, NotImplementedError) as exc:
        result = create_error_response(exc)  # vLLM's own mapping: 400, 404, 422, 503, ...
    if result is None:  # the client disconnected
        return Response(status_code=499)
    if isinstance(result, ErrorResponse):
        return JSONResponse(result.model_dump(), status_code=result.error.code)
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump())
    return StreamingResponse(result, media_type="text/event-stream")


def openai_error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    """An error in the OpenAI shape (the ``openai`` client raises the matching class)."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": status}}, status_code=status)  # fmt: skip


def vllm_priority(header: str | None) -> int:
    """``X-Ember-Priority`` → vLLM priority (lower first); health is for probes only."""
    try:
        return int(Priority.requested(header))
    except ValueError as exc:
        raise InvalidInput(str(exc)) from exc


def _read_report(path: Path) -> LoadReport | None:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    stages = [Stage(s["name"], s["bytes"], s["seconds"]) for s in raw.pop("stages", [])]
    keep = {k: raw[k] for k in LoadReport.__dataclass_fields__ if k in raw and k != "stages"}
    path.unlink(missing_ok=True)
    return LoadReport(**keep, stages=stages)


async def _awaited(coro: Awaitable[Any]) -> Any:
    return await coro


def _close(coro: Awaitable[Any]) -> None:
    close = getattr(coro, "close", None)
    if close is not None:
        close()


# --- launcher ------------------------------------------------------------------------
