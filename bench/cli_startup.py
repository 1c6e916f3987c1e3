"""How fast the ``ember`` command starts: ``ember --help`` and a client command, ``ember
models ls``, against a live ``ember serve``.

Each command runs ``--runs`` times (after one warm-up) as its own process, timed from
outside: wall seconds from start to exit, and CPU seconds (user + system, the kernel's
accounting of the finished child). A bare interpreter (``python -c pass``) is timed the
same way: the floor no command can go under, and a gauge of how loaded the machine is.
By default the interpreter may cache bytecode (in a temporary ``PYTHONPYCACHEPREFIX``,
as an installed package has its ``.pyc`` files); ``--no-bytecode-cache`` compiles every
module on every run, the standard library's too (and so does the floor): the image's
case, whose packages ``uv`` installs without bytecode under ``PYTHONDONTWRITEBYTECODE``,
plus the standard library. ``PYTHONDONTWRITEBYTECODE`` alone would not do it: it stops
the writing of ``.pyc`` files, but any ``__pycache__`` beside the sources (the
checkout's, site-packages') is still read; the prefix is an empty directory then. The
modules that cost ``ember --help`` most come from ``python -X importtime``.

Medians, min and max in a table; the last line is one JSON object with the medians.

    python bench/cli_startup.py [--runs 9] [--no-bytecode-cache]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

EMBER = str(Path(sys.executable).with_name("ember"))
ADMIN_KEY = "ek_bench_cli_startup_admin_key_0123456789"


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """One run: (wall s, cpu s, exit code)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.returncode


def measure(cmd: list[str], env: dict[str, str], runs: int) -> dict[str, Any]:
    timed(cmd, env)  # warm-up: the page cache, and the bytecode cache when there is one
    walls, cpus, codes = [], [], set()
    for _ in range(runs):
        wall, cpu, code = timed(cmd, env)
        walls.append(wall)
        cpus.append(cpu)
        codes.add(code)
    return {"wall": walls, "cpu": cpus, "codes": sorted(codes)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_api(data_dir: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    data_dir.mkdir(parents=True)
    port = free_port()
    server_env = env | {
        "EMBER_DATA_DIR": str(data_dir),
        "EMBER_PORT": str(port),
        "EMBER_ADMIN_KEY": ADMIN_KEY,
        "EMBER_POOLS_ENABLED": "false",
    }
    log = (data_dir / "serve.log").open("wb")
    proc = subprocess.Popen([EMBER, "serve"], env=server_env, stdout=log, stderr=log,
                            start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"ember serve exited: {(data_dir / 'serve.log').read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("ember serve did not answer /healthz within 120 s")


def top_imports(env: dict[str, str], n: int = 8) -> list[tuple[str, float]]:
    """The top-level imports of ``ember --help`` that cost most (cumulative seconds)."""
    code = "from ember.cli import app\ntry:\n    app(['--help'])\nexcept SystemExit:\n    pass"
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=env,
                          capture_output=True, text=True)  # fmt: skip
    rows = []
    for line in done.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[2].startswith(" ") and not parts[2].startswith("  "):
            try:
                rows.append((parts[2].strip(), int(parts[1]) / 1e6))
            except ValueError:
                continue
    return sorted(rows, key=lambda r: -r[1])[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--no-bytecode-cache", action="store_true")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ember-cli-bench-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env["COLUMNS"] = "120"
    env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    if args.no_bytecode_cache:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    proc = None
    try:
        results = {
            "python": measure([sys.executable, "-c", "pass"], env, args.runs),
            "help": measure([EMBER, "--help"], env, args.runs),
        }
        proc, url = start_api(work / "data", env)
        client_env = env | {"EMBER_URL": url, "EMBER_API_KEY": ADMIN_KEY}
        httpx.post(f"{url}/v1/models", json={"name": "bench"},
                   headers={"Authorization": f"Bearer {ADMIN_KEY}"}).raise_for_status()  # fmt: skip
        results["models_ls"] = measure([EMBER, "models", "ls"], client_env, args.runs)
        imports = top_imports(env)
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)

    cache = "off" if args.no_bytecode_cache else "on"
    print(f"ember CLI start-up, {args.runs} runs each, bytecode cache {cache}")
    print(f"{'command':22} {'wall med':>9} {'min':>7} {'max':>7} {'cpu med':>8} {'exit':>5}")
    names = {"python": "python -c pass", "help": "ember --help", "models_ls": "ember models ls"}
    summary: dict[str, Any] = {"runs": args.runs, "bytecode_cache": not args.no_bytecode_cache}
    for key, r in results.items():
        wall, cpu = statistics.median(r["wall"]), statistics.median(r["cpu"])
        print(f"{names[key]:22} {wall:9.3f} {min(r['wall']):7.3f} {max(r['wall']):7.3f} "
              f"{cpu:8.3f} {','.join(map(str, r['codes'])):>5}")  # fmt: skip
        summary[f"{key}_s"] = round(wall, 4)
        summary[f"{key}_cpu_s"] = round(cpu, 4)
    print("ember --help, costliest top-level imports (cumulative s):")
    for name, seconds in imports:
        print(f"  {name:40} {seconds:.3f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
