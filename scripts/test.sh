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
$VENV/bin/lint-imports  # the layers of ember/ (pyproject.toml, [tool.importlinter])

# Two pytest workers (pytest-xdist; TEST_WORKERS to change, 0 for none): most tests
# wait on real processes starting (engines import torch), so a second worker fills the
# other core. --dist loadfile: a file's tests run in order on one worker, its module
# fixtures set up once (loadgroup is no use with pytest 9: xdist 3.8 renames node ids
# through an attribute pytest 9 no longer reads). A package-scoped platform (tests/batch,
# tests/jobs) starts once per worker that runs one of its files, so those tests must not
# depend on another file's leftovers. Each worker starts its own Redis / PostgreSQL /
# moto (session fixtures, free ports).
# --durations: where the suite's time goes (it must stay well under 20 minutes).
workers=${TEST_WORKERS:-2}
xdist=()
if [ "$workers" != 0 ]; then xdist=(-n "$workers" --dist loadfile); fi
mapfile -t first < <(ls -d tests/*/ tests/test_*.py | grep -v -e '^tests/engine_vllm/' -e '^tests/infra/')
status=0
suite() {  # pytest with the workers; "no tests collected" (5: a filter that selects none
  # of this phase) is not a failure, the first real failure is the script's status
  local rc=0
  $VENV/bin/python -m pytest "${xdist[@]}" "$@" || rc=$?
  if [ "$rc" != 0 ] && [ "$rc" != 5 ] && [ "$status" = 0 ]; then status=$rc; fi
}
suite --durations=25 "${first[@]}" "$@"
# Then the suites that wait for the background set-ups (they would hold a worker idle),
# in one process: two vLLM engines at once on two cores starve each other.
xdist=()
suite --durations=10 tests/engine_vllm tests/infra "$@"
exit "$status"
