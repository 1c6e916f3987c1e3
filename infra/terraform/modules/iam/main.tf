# IRSA roles, one per Ember process kind. Each may read only the prefixes it uses and
# write only under its own prefixes; write actions are listed one by one, never "*".
#
#   role        service account   reads                                      writes
#   api         ember-api         artifacts, prediction-logs, batch-outputs, artifacts, prediction-logs
#                                 job-results
#   worker      ember-worker      artifacts, batch-outputs, job-results      batch-outputs, job-results,
#                                                                            prediction-logs
#   replica     ember-engine      artifacts                                  -
#
# The pools controller runs inside the API pods (ember-api): no role of its own. Beat only
# enqueues tasks: its service account has no AWS role at all.

data "aws_region" "current" {}

locals {
  issuer_host = trimprefix(var.oidc_issuer_url, "https://")

  # Object-level actions. Reads: GET/HEAD (ranged GETs included). Writes: single and
  # multipart PUTs (CreateMultipartUpload/UploadPart/Complete authorise as PutObject).
  read_actions  = ["s3:GetObject"]
  write_actions = ["s3:PutObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"]

  roles = {
    api = {
      service_account = "ember-api"
      reads           = ["artifacts", "prediction_logs", "batch_outputs", "job_results"]
      writes          = ["artifacts", "prediction_logs"]
    }
    worker = {
      service_account = "ember-worker"
      reads           = ["artifacts", "batch_outputs", "job_results"]
      writes          = ["batch_outputs", "job_results", "prediction_logs"]
    }
    replica = {
      service_account = "ember-engine"
      reads           = ["artifacts"]
      writes          = []
    }
  }

  policies = {
    for role, r in local.roles : role => {
      Version = "2012-10-17"
      Statement = concat(
        [
          {
            Sid      = "ListOwnPrefixes"
            Effect   = "Allow"
            Action   = ["s3:ListBucket"]
            Resource = [var.bucket_arn]
            Condition = {
              StringLike = {
                "s3:prefix" = flatten([for p in r.reads : [var.prefixes[p], "${var.prefixes[p]}*"]])
              }
            }
          },
          {
            Sid      = "ReadOwnPrefixes"
            Effect   = "Allow"
            Action   = local.read_actions
            Resource = [for p in r.reads : "${var.bucket_arn}/${var.prefixes[p]}*"]
          },
          {
            Sid      = "DecryptBucketObjects"
            Effect   = "Allow"
            Action   = ["kms:Decrypt"]
            Resource = [var.kms_key_arn]
            Condition = {
              StringEquals = { "kms:ViaService" = "s3.${data.aws_region.current.name}.amazonaws.com" }
            }
          },
        ],
        # Roles that write nothing get no write statement at all.
        [for s in [
          {
            Sid      = "WriteOwnPrefixes"
            Effect   = "Allow"
            Action   = local.write_actions
            Resource = [for p in r.writes : "${var.bucket_arn}/${var.prefixes[p]}*"]
          },
          {
            Sid      = "EncryptBucketObjects"
            Effect   = "Allow"
            Action   = ["kms:GenerateDataKey"]
            Resource = [var.kms_key_arn]
            Condition = {
              StringEquals = { "kms:ViaService" = "s3.${data.aws_region.current.name}.amazonaws.com" }
            }
          },
        ] : s if length(r.writes) > 0],
      )
    }
  }
}

resource "aws_iam_role" "this" {
  for_each    = local.roles
  name        = "${var.name}-${each.key}"
  description = "Ember ${each.key} (IRSA: ${var.namespace}/${each.value.service_account})"
  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Federated = var.oidc_provider_arn }
      Action    = "sts:AssumeRoleWithWebIdentity"
      Condition = {
        StringEquals = {
          "${local.issuer_host}:sub" = "system:serviceaccount:${var.namespace}:${each.value.service_account}"
          "${local.issuer_host}:aud" = "sts.amazonaws.com"
        }
      }
    }]
  })
  max_session_duration = 3600
  tags                 = var.tags
}

resource "aws_iam_role_policy" "this" {
  for_each = local.roles
  name     = "ember-${each.key}-artifact-bucket"
  role     = aws_iam_role.this[each.key].id
  policy   = jsonencode(local.policies[each.key])
}
