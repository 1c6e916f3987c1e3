# Artifact bucket: SSE-KMS, versioned, never public, TLS only, lifecycle per prefix.

mock_provider "aws" {
  source = "./tests/mocks"
}

variables {
  name = "ember-test"
}

run "bucket_is_encrypted_private_and_tls_only" {
  command = apply

  module {
    source = "./modules/storage"
  }

  assert {
    condition     = aws_s3_bucket.artifacts.bucket == "ember-test-artifacts-123456789012"
    error_message = "Default bucket name must be <name>-artifacts-<account id>."
  }

  assert {
    condition = alltrue([
      for r in aws_s3_bucket_server_side_encryption_configuration.artifacts.rule :
      alltrue([for d in r.apply_server_side_encryption_by_default : d.sse_algorithm == "aws:kms" && d.kms_master_key_id == aws_kms_key.this.arn])
    ])
    error_message = "The artifact bucket must default to SSE-KMS with the deployment's customer-managed key."
  }

  assert {
    condition     = aws_kms_key.this.enable_key_rotation
    error_message = "The KMS key must rotate."
  }

  assert {
    condition = alltrue([
      for b in [aws_s3_bucket_public_access_block.artifacts, aws_s3_bucket_public_access_block.access_logs] :
      b.block_public_acls && b.block_public_policy && b.ignore_public_acls && b.restrict_public_buckets
    ])
    error_message = "Both buckets must block every form of public access."
  }

  assert {
    condition     = aws_s3_bucket_ownership_controls.artifacts.rule[0].object_ownership == "BucketOwnerEnforced"
    error_message = "ACLs must be disabled (BucketOwnerEnforced)."
  }

  assert {
    condition     = aws_s3_bucket_versioning.artifacts.versioning_configuration[0].status == "Enabled"
    error_message = "The artifact bucket must be versioned."
  }

  assert {
    condition = anytrue([
      for s in jsondecode(aws_s3_bucket_policy.artifacts.policy).Statement :
      s.Effect == "Deny" && s.Principal == "*" && s.Action == "s3:*"
      && try(s.Condition.Bool["aws:SecureTransport"], "") == "false"
      && toset(s.Resource) == toset([aws_s3_bucket.artifacts.arn, "${aws_s3_bucket.artifacts.arn}/*"])
    ])
    error_message = "The bucket policy must deny every request not made over TLS, on the bucket and its objects."
  }

  assert {
    condition = alltrue([
      for s in jsondecode(aws_s3_bucket_policy.artifacts.policy).Statement : s.Effect == "Deny"
    ])
    error_message = "The artifact bucket policy may only deny: access is granted by IAM roles, never to a public principal."
  }

  assert {
    condition     = aws_s3_bucket_logging.artifacts.target_bucket == aws_s3_bucket.access_logs.id
    error_message = "Server access logs must go to the access-log bucket."
  }
}

run "lifecycle_expires_old_logs_and_outputs" {
  command = apply

  module {
    source = "./modules/storage"
  }

  variables {
    prediction_log_retention_days = 60
    batch_output_retention_days   = 21
  }

  assert {
    condition = one([
      for r in aws_s3_bucket_lifecycle_configuration.artifacts.rule : r.expiration[0].days
      if r.status == "Enabled" && try(r.filter[0].prefix, "") == "prediction-logs/"
    ]) == 60
    error_message = "prediction-logs/ must expire after prediction_log_retention_days."
  }

  assert {
    condition = one([
      for r in aws_s3_bucket_lifecycle_configuration.artifacts.rule : r.expiration[0].days
      if r.status == "Enabled" && try(r.filter[0].prefix, "") == "batch-outputs/"
    ]) == 21
    error_message = "batch-outputs/ must expire after batch_output_retention_days."
  }

  assert {
    condition = length([
      for r in aws_s3_bucket_lifecycle_configuration.artifacts.rule : r
      if length(r.expiration) > 0 && try(r.filter[0].prefix, "") == "artifacts/"
    ]) == 0
    error_message = "Current artifact versions must never expire."
  }

  assert {
    condition = anytrue([
      for r in aws_s3_bucket_lifecycle_configuration.artifacts.rule :
      length(r.abort_incomplete_multipart_upload) > 0
    ])
    error_message = "Incomplete multipart uploads must be aborted."
  }

  assert {
    condition     = output.object_store_url == "s3://ember-test-artifacts-123456789012/artifacts"
    error_message = "object_store_url must point at the artifacts/ prefix."
  }
}

run "registry_is_immutable_and_encrypted" {
  command = apply

  module {
    source = "./modules/storage"
  }

  assert {
    condition     = aws_ecr_repository.ember.image_tag_mutability == "IMMUTABLE" && aws_ecr_repository.ember.image_scanning_configuration[0].scan_on_push
    error_message = "ECR tags must be immutable and images scanned on push."
  }

  assert {
    condition     = aws_ecr_repository.ember.encryption_configuration[0].encryption_type == "KMS"
    error_message = "ECR must encrypt with KMS."
  }
}

run "retention_must_be_positive" {
  command = plan

  module {
    source = "./modules/storage"
  }

  variables {
    batch_output_retention_days = 0
  }

  expect_failures = [var.batch_output_retention_days]
}
