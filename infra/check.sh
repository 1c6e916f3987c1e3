#!/usr/bin/env bash
# Every infrastructure check of Ember, end to end; exits non-zero if any step fails.
#
#   bash infra/check.sh
#
# Steps (each timed, all run even after a failure, summary at the end):
#   tools        .venv-infra at the repo root: checkov, kubernetes-validate, moto[server]
#                (pinned; reused when present)
#   fmt          terraform fmt -check -recursive
#   validate     terraform init -backend=false + validate: root, every module, moto harness
#   tftest       terraform test (mock_provider "aws"): the security properties
#   checkov      zero failed checks; every skip is a #checkov:skip with a reason in the .tf
#   userdata     the GPU nodes' NVMe script: bash -n (and shellcheck when installed)
#   k8s          kustomize render (base, aws overlay, cluster add-ons), kubernetes-validate
#                --strict for each EKS Kubernetes version, Ember's manifest rules
#   moto         a moto server on a free loopback port; terraform apply of storage,
#                network, cluster, data (less ElastiCache) and iam; verify.py checks what
#                was created; destroy; the state must end empty. Runs in the background
#                while the offline steps run, and is always stopped.
#
# Without the provider mirror (find / -maxdepth 2 -type d -name tf-plugins; or set
# TF_PLUGIN_MIRROR) the steps that need the AWS provider are skipped, loudly.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TF_DIR=$ROOT/infra/terraform
MOTO_DIR=$TF_DIR/moto
K8S_DIR=$ROOT/deploy/k8s
VENV=$ROOT/.venv-infra
PY=$VENV/bin/python
K8S_VERSIONS="1.30.0 1.31.0 1.32.0 1.33.0"
REQUIREMENTS="checkov==3.3.30 kubernetes-validate==1.37.0 moto[server]==5.2.5"

export TF_IN_AUTOMATION=1 TF_INPUT=0 CHECKPOINT_DISABLE=1
export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_DEFAULT_REGION=us-east-1
export AWS_EC2_METADATA_DISABLED=true
unset AWS_PROFILE AWS_SESSION_TOKEN

# --- the moto flow, run as its own process group (see start_moto_flow) -------------------
if [[ "${1:-}" == "__moto_flow" ]]; then
  work=$2
  port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  endpoint="http://127.0.0.1:$port"
  MOTO_IAM_LOAD_MANAGED_POLICIES=true "$VENV/bin/moto_server" -H 127.0.0.1 -p "$port" \
    > "$work/moto-server.log" 2>&1 &
  moto_pid=$!
  trap 'kill "$moto_pid" 2>/dev/null; wait "$moto_pid" 2>/dev/null' EXIT
  for _ in $(seq 100); do
    "$PY" -c "import urllib.request as u; u.urlopen('$endpoint/moto-api/', timeout=1)" 2>/dev/null && break
    sleep 0.2
  done
  echo "moto server $endpoint (pid $moto_pid)"
  # A private copy of the Terraform tree: validate runs init in the same directories
  # meanwhile, and nothing of this run (state, .terraform) must land in the repo.
  mkdir -p "$work/tf"
  tar -C "$TF_DIR" --exclude=.terraform --exclude=.terraform.lock.hcl --exclude='*.tfstate*' -cf - . \
    | tar -C "$work/tf" -xf -
  tf() { terraform -chdir="$work/tf/moto" "$@" -no-color; }
  vars=(-var "endpoint=$endpoint")
  rc=0
  tf init -input=false -reconfigure -backend-config="path=$work/moto.tfstate" > "$work/moto-init.log" 2>&1 \
    || { cat "$work/moto-init.log"; exit 1; }
  echo "--- apply"
  if tf apply -auto-approve -input=false -parallelism=20 "${vars[@]}" > "$work/moto-apply.log" 2>&1; then
    grep -E '^Apply complete' "$work/moto-apply.log"
    echo "--- verify"
    tf output -json | "$PY" "$work/tf/moto/verify.py" "$endpoint" || rc=1
  else
    rc=1
    grep -E -A12 '^Error' "$work/moto-apply.log" | head -80
  fi
  echo "--- destroy"
  if tf destroy -auto-approve -input=false -refresh=false -parallelism=20 "${vars[@]}" \
    > "$work/moto-destroy.log" 2>&1; then
    grep -E '^Destroy complete' "$work/moto-destroy.log"
  else
    rc=1
    grep -E -A12 '^Error' "$work/moto-destroy.log" | head -60
  fi
  left=$(tf state list 2>/dev/null | wc -l)
  [[ "$left" == 0 ]] || { echo "FAIL: $left resources left in the moto state"; rc=1; }
  exit $rc
fi

# --- helpers -------------------------------------------------------------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ember-infra.XXXXXX")
MOTO_FLOW_PID=
cleanup() {
  if [[ -n "$MOTO_FLOW_PID" ]] && kill -0 "$MOTO_FLOW_PID" 2>/dev/null; then
    kill -TERM -- "-$MOTO_FLOW_PID" 2>/dev/null
    sleep 1
    kill -KILL -- "-$MOTO_FLOW_PID" 2>/dev/null
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

SUMMARY=()
FAILED=0
step() {  # step NAME COMMAND...: run, time, record
  local name=$1 start rc
  shift
  echo
  echo "=== $name"
  start=$(date +%s)
  "$@"
  rc=$?
  local secs=$(($(date +%s) - start))
  if [[ $rc == 0 ]]; then
    SUMMARY+=("ok    $name (${secs}s)")
  else
    SUMMARY+=("FAIL  $name (${secs}s, exit $rc)")
    FAILED=1
  fi
  return 0
}
skip() {
  SUMMARY+=("SKIP  $1: $2")
}
loud() {
  printf '\n%s\n' "################################################################################"
  printf '### %s\n' "$@"
  printf '%s\n\n' "################################################################################"
}

# --- steps ---------------------------------------------------------------------------------
tools() {
  if [[ -x "$VENV/bin/checkov" && -x "$VENV/bin/kubernetes-validate" && -x "$VENV/bin/moto_server" ]] \
    && [[ "$(cat "$VENV/.ember-requirements" 2>/dev/null)" == "$REQUIREMENTS" ]]; then
    echo "reusing $VENV"
    return 0
  fi
  rm -rf "$VENV"
  python3 -m venv "$VENV" || return 1
  # shellcheck disable=SC2086 # word splitting of the requirement list is intended
  "$VENV/bin/pip" install --quiet --disable-pip-version-check $REQUIREMENTS > "$WORK/pip.log" 2>&1 \
    || { tail -30 "$WORK/pip.log"; return 1; }
  echo "$REQUIREMENTS" > "$VENV/.ember-requirements"
  "$VENV/bin/pip" list --disable-pip-version-check 2>/dev/null | grep -iE '^(checkov|kubernetes-validate|moto) '
}

fmt() {
  terraform -chdir="$TF_DIR" fmt -check -recursive -diff -no-color
}

validate_one() {
  local d=$1 log status
  log="$WORK/validate-$(basename "$d").log"
  terraform -chdir="$d" init -backend=false -input=false -no-color > "$log" 2>&1 \
    && terraform -chdir="$d" validate -no-color >> "$log" 2>&1
  status=$?
  echo "$([[ $status == 0 ]] && echo ok || echo FAIL) ${d#"$ROOT"/}"
  [[ $status == 0 ]] || cat "$log"
  return $status
}

validate() {
  local dirs=("$TF_DIR" "$TF_DIR"/modules/* "$MOTO_DIR") rc=0 i a b
  # Two at a time: each run loads the whole AWS provider schema.
  for ((i = 0; i < ${#dirs[@]}; i += 2)); do
    validate_one "${dirs[i]}" &
    a=$!
    b=
    if ((i + 1 < ${#dirs[@]})); then
      validate_one "${dirs[i + 1]}" &
      b=$!
    fi
    wait "$a" || rc=1
    if [[ -n "$b" ]]; then wait "$b" || rc=1; fi
  done
  return $rc
}

tftest() {
  terraform -chdir="$TF_DIR" test -no-color 2>&1 | grep -vE '^\s*$'
}

run_checkov() {
  # moto/ is a test harness that turns protections off on purpose; it is not deployed.
  BC_SKIP_MAPPING=TRUE "$VENV/bin/checkov" -d "$TF_DIR" --framework terraform --skip-download \
    --skip-path moto --compact --quiet -o cli
}

userdata() {
  local script=$WORK/nvme-cache.sh
  sed -e 's/\${mount_path}/\/mnt\/nvme/g' -e 's/\${cache_dir}/\/mnt\/nvme\/ember-cache/g' \
    -e 's/\${cache_uid}/10001/g' -e 's/\$\${/${/g' \
    "$TF_DIR/modules/cluster/templates/nvme-cache.sh.tftpl" > "$script"
  bash -n "$script" || return 1
  if command -v shellcheck > /dev/null; then
    shellcheck "$script" || return 1
  else
    echo "shellcheck not installed: bash -n only"
  fi
  echo "nvme-cache.sh: syntax ok"
}

render() {  # render KUSTOMIZATION_DIR OUT: kubectl kustomize, or each file as it is
  if command -v kubectl > /dev/null; then
    kubectl kustomize "$1" > "$2"
  else
    echo "kubectl not found: validating each resource file without kustomize" >&2
    local f
    for f in "$1"/*.yaml; do
      [[ "$(basename "$f")" == kustomization.yaml ]] || { cat "$f"; echo "---"; }
    done > "$2"
  fi
}

k8s() {
  local rc=0 overlay=$WORK/k8s/overlays/aws v
  mkdir -p "$WORK/k8s"
  cp -r "$K8S_DIR/base" "$K8S_DIR/overlays" "$K8S_DIR/cluster-addons" "$WORK/k8s/"
  # The aws overlay needs the env files render-env.sh writes from Terraform: stand-ins,
  # with other values than the base's, so that a value the overlay fails to substitute
  # shows up in check_manifests.py --overlay.
  sed -e 's/123456789012/210987654321/g' "$K8S_DIR/base/ember-config.env" > "$overlay/ember-config.env"
  { sed -e 's/123456789012/210987654321/g' -e 's/^GPU_TYPES=.*/GPU_TYPES=nvidia-h100,nvidia-l40s/' \
      "$K8S_DIR/base/ember-infra.env"
    echo "IMAGE=210987654321.dkr.ecr.us-east-1.amazonaws.com/ember:0.2.0"; } > "$overlay/ember-infra.env"
  printf '%s\n' "EMBER_ADMIN_KEY=0123456789abcdef0123456789abcdef" \
    "EMBER_DATABASE_URL=postgresql+psycopg://ember:pw@db.example:5432/ember?sslmode=require" \
    "EMBER_REDIS_URL=rediss://:token@redis.example:6379/0" > "$overlay/ember-secrets.env"
  render "$WORK/k8s/base" "$WORK/base.yaml" || return 1
  render "$overlay" "$WORK/overlay-aws.yaml" || return 1
  render "$WORK/k8s/cluster-addons" "$WORK/cluster-addons.yaml" || return 1
  for v in $K8S_VERSIONS; do
    "$VENV/bin/kubernetes-validate" --strict --quiet -k "$v" \
      "$WORK/base.yaml" "$WORK/overlay-aws.yaml" "$WORK/cluster-addons.yaml" || rc=1
    echo "kubernetes-validate --strict -k $v: $([[ $rc == 0 ]] && echo ok || echo FAIL)"
  done
  if command -v kubectl > /dev/null; then
    "$PY" "$K8S_DIR/tests/check_manifests.py" "$WORK/base.yaml" || rc=1
    "$PY" "$K8S_DIR/tests/check_manifests.py" "$WORK/overlay-aws.yaml" --overlay || rc=1
  fi
  return $rc
}

start_moto_flow() {
  setsid bash "${BASH_SOURCE[0]}" __moto_flow "$WORK" > "$WORK/moto-flow.log" 2>&1 &
  MOTO_FLOW_PID=$!
  MOTO_START=$(date +%s)
}

finish_moto_flow() {
  local rc
  wait "$MOTO_FLOW_PID"
  rc=$?
  MOTO_FLOW_PID=
  cat "$WORK/moto-flow.log"
  echo "(moto flow took $(($(date +%s) - MOTO_START))s in the background)"
  return $rc
}

# --- main ----------------------------------------------------------------------------------
echo "Ember infra checks ($ROOT), work dir $WORK"
step tools tools
if [[ ! -x "$VENV/bin/checkov" ]]; then
  loud "cannot install the infra tools into $VENV: nothing else can run"
  printf '%s\n' "${SUMMARY[@]}"
  exit 1
fi

HAVE_TF=1
command -v terraform > /dev/null || HAVE_TF=0
MIRROR=${TF_PLUGIN_MIRROR:-$(find / -maxdepth 2 -type d -name tf-plugins 2> /dev/null | head -1)}
if [[ $HAVE_TF == 1 && -n "$MIRROR" && -d "$MIRROR" ]]; then
  cat > "$WORK/terraform.rc" <<EOF
provider_installation {
  filesystem_mirror {
    path = "$MIRROR"
  }
}
EOF
  export TF_CLI_CONFIG_FILE=$WORK/terraform.rc
  echo "terraform $(terraform version | head -1 | cut -d' ' -f2), AWS provider mirror: $MIRROR"
  HAVE_MIRROR=1
else
  HAVE_MIRROR=0
  loud "NO TERRAFORM AWS PROVIDER MIRROR (tf-plugins) $([[ $HAVE_TF == 0 ]] && echo "AND NO terraform BINARY")" \
    "init/validate, terraform test and the moto apply/destroy are SKIPPED." \
    "Set TF_PLUGIN_MIRROR=<dir> or run on a machine with the mirror to check them."
  export TF_CLI_CONFIG_FILE=/dev/null
fi

if [[ $HAVE_MIRROR == 1 ]]; then
  start_moto_flow
fi

if [[ $HAVE_TF == 1 ]]; then step fmt fmt; else skip fmt "no terraform binary"; fi
if [[ $HAVE_MIRROR == 1 ]]; then
  step validate validate
  step tftest tftest
else
  skip validate "no provider mirror"
  skip tftest "no provider mirror"
fi
step checkov run_checkov
step userdata userdata
step k8s k8s
if [[ $HAVE_MIRROR == 1 ]]; then
  step moto finish_moto_flow
else
  skip moto "no provider mirror"
fi

echo
echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
if [[ $HAVE_MIRROR == 0 ]]; then
  loud "provider mirror missing: Terraform validate/test/apply were NOT checked"
fi
exit $FAILED
