# IRSA: replicas read the bucket only; api and workers write only under their own
# prefixes; no action that writes is a wildcard; each role trusts exactly one service
# account.

mock_provider "aws" {
  source = "./tests/mocks"
}

variables {
  name              = "ember-test"
  oidc_provider_arn = "arn:aws:iam::123456789012:oidc-provider/oidc.eks.us-east-1.amazonaws.com/id/MOCK"
  oidc_issuer_url   = "https://oidc.eks.us-east-1.amazonaws.com/id/MOCK"
  bucket_arn        = "arn:aws:s3:::ember-test-artifacts"
  kms_key_arn       = "arn:aws:kms:us-east-1:123456789012:key/11111111-2222-3333-4444-555555555555"
}

run "writes_are_scoped_to_prefixes" {
  command = apply

  module {
    source = "./modules/iam"
  }

  # Every S3/KMS action in any Allow statement, by role.
  assert {
    condition = alltrue(flatten([
      for role, p in aws_iam_role_policy.this : [
        for s in jsondecode(p.policy).Statement : [
          for a in s.Action : !strcontains(a, "*")
        ]
      ]
    ]))
    error_message = "No action may be a wildcard."
  }

  assert {
    condition = alltrue(flatten([
      for role, p in aws_iam_role_policy.this : [
        for s in jsondecode(p.policy).Statement : [
          for r in s.Resource : r != "*" && r != "${var.bucket_arn}/*"
        ]
      ]
    ]))
    error_message = "No statement may cover every resource or every object of the bucket."
  }

  assert {
    condition = toset(flatten([
      for s in jsondecode(aws_iam_role_policy.this["api"].policy).Statement : s.Resource if contains(s.Action, "s3:PutObject")
    ])) == toset(["${var.bucket_arn}/artifacts/*", "${var.bucket_arn}/prediction-logs/*"])
    error_message = "The API may write only artifacts/ and prediction-logs/."
  }

  assert {
    condition = toset(flatten([
      for s in jsondecode(aws_iam_role_policy.this["worker"].policy).Statement : s.Resource if contains(s.Action, "s3:PutObject")
    ])) == toset(["${var.bucket_arn}/batch-outputs/*", "${var.bucket_arn}/job-results/*", "${var.bucket_arn}/prediction-logs/*"])
    error_message = "Workers may write only batch-outputs/, job-results/ and prediction-logs/."
  }
}

run "replicas_only_read" {
  command = apply

  module {
    source = "./modules/iam"
  }

  assert {
    condition = alltrue(flatten([
      for s in jsondecode(aws_iam_role_policy.this["replica"].policy).Statement : [
        for a in s.Action : contains(["s3:GetObject", "s3:ListBucket", "kms:Decrypt"], a)
      ]
    ]))
    error_message = "Replicas may only GetObject, ListBucket and kms:Decrypt."
  }

  assert {
    condition = toset(flatten([
      for s in jsondecode(aws_iam_role_policy.this["replica"].policy).Statement : s.Resource if contains(s.Action, "s3:GetObject")
    ])) == toset(["${var.bucket_arn}/artifacts/*"])
    error_message = "Replicas may read only artifacts/."
  }

  assert {
    condition = alltrue([
      for s in jsondecode(aws_iam_role_policy.this["replica"].policy).Statement :
      alltrue([for p in try(s.Condition.StringLike["s3:prefix"], ["artifacts/"]) : startswith(p, "artifacts/")])
    ])
    error_message = "Replicas may list only under artifacts/."
  }

  assert {
    condition = alltrue([
      for s in jsondecode(aws_iam_role_policy.this["replica"].policy).Statement :
      s.Condition.StringEquals["kms:ViaService"] == "s3.us-east-1.amazonaws.com" if contains(s.Action, "kms:Decrypt")
    ])
    error_message = "KMS use must be limited to requests made through S3."
  }
}

run "each_role_trusts_one_service_account" {
  command = apply

  module {
    source = "./modules/iam"
  }

  assert {
    condition = alltrue([
      for role, r in aws_iam_role.this :
      jsondecode(r.assume_role_policy).Statement[0].Action == "sts:AssumeRoleWithWebIdentity"
      && jsondecode(r.assume_role_policy).Statement[0].Principal.Federated == var.oidc_provider_arn
      && jsondecode(r.assume_role_policy).Statement[0].Condition.StringEquals["oidc.eks.us-east-1.amazonaws.com/id/MOCK:sub"] == "system:serviceaccount:ember:${output.service_accounts[role]}"
      && jsondecode(r.assume_role_policy).Statement[0].Condition.StringEquals["oidc.eks.us-east-1.amazonaws.com/id/MOCK:aud"] == "sts.amazonaws.com"
    ])
    error_message = "Each role must be assumable only by its own service account in the ember namespace."
  }

  assert {
    condition     = output.service_accounts == { api = "ember-api", worker = "ember-worker", replica = "ember-engine" }
    error_message = "Service account names must match deploy/k8s."
  }
}

run "prefix_must_be_one_segment" {
  command = plan

  module {
    source = "./modules/iam"
  }

  variables {
    prefixes = {
      artifacts       = "*"
      prediction_logs = "prediction-logs/"
      batch_outputs   = "batch-outputs/"
      job_results     = "job-results/"
    }
  }

  expect_failures = [var.prefixes]
}
