#!/usr/bin/env bash
# Write the overlay's env files from the Terraform outputs and the app secret.
#   usage: deploy/k8s/overlays/aws/render-env.sh IMAGE_TAG
# Needs: terraform (state of infra/terraform), aws CLI v2 with access to the secret,
# python3. TF_DIR overrides the Terraform directory.
set -euo pipefail

tag=${1:?usage: render-env.sh IMAGE_TAG}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tf_dir=${TF_DIR:-$here/../../../../infra/terraform}
tf() { terraform -chdir="$tf_dir" output -raw "$1"; }

tf ember_config_env > "$here/ember-config.env"
{
  tf infra_env
  echo "IMAGE=$(tf ecr_repository_url):$tag"
} > "$here/ember-infra.env"

umask 077
aws secretsmanager get-secret-value \
  --region "$(tf region)" --secret-id "$(tf app_secret_arn)" \
  --query SecretString --output text |
  python3 -c 'import json, sys; print("".join(f"{k}={v}\n" for k, v in sorted(json.load(sys.stdin).items())), end="")' \
    > "$here/ember-secrets.env"

echo "wrote $here/{ember-config,ember-infra,ember-secrets}.env; now: kubectl apply -k $here"
