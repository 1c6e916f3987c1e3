#!/usr/bin/env bash
# The whole check, as `make test` runs it. The two slow set-ups that do not compete for
# the same resources as the main suite run in the background while it runs: building the
# vLLM venv (downloads, disk) and infra/check.sh (mostly the AWS provider's own waits
# against moto). Their tests (tests/engine_vllm, tests/infra) run last and wait for them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
export TEST_JOBS_DIR
TEST_JOBS_DIR=$(mktemp -d -t ember-test-jobs.XXXXXX)
pgids=()
background() {  # background NAME COMMAND...: output to $TEST_JOBS_DIR/NAME.log, status to NAME.rc
  local name=$1
  shift
  setsid bash -c '"$@" >"$TEST_JOBS_DIR/$0.log" 2>&1; echo $? >"$TEST_JOBS_DIR/$0.rc"' "$name" "$@" &
  pgids+=($!)
}
cleanup() {
  for pgid in "${pgids[@]}"; do kill -- "-$pgid" 2>/dev/null || true; done
}
trap cleanup EXIT

background vllm-venv scripts/vllm-venv.sh
background infra bash infra/check.sh

$VENV/bin/ruff check ember tests bench scripts
$VENV/bin/ruff format --check ember tests bench scripts
$VENV/bin/mypy

mapfile -t first < <(ls -d tests/*/ tests/test_*.py | grep -v -e '^tests/engine_vllm/' -e '^tests/infra/')
# --durations: where the suite's time goes (it must stay well under 20 minutes)
$VENV/bin/python -m pytest --durations=25 "${first[@]}" tests/engine_vllm tests/infra "$@"
