# The artifact bucket: versioned, SSE-KMS, never public, TLS only, with lifecycle rules
# for the prefixes Ember writes. Its server access logs go to a second bucket.

locals {
  bucket_name = coalesce(var.bucket_name, "${var.name}-artifacts-${local.account_id}")
  # Object prefixes Ember uses; IAM (modules/iam) scopes writes to exactly these.
  prefixes = {
    artifacts       = "artifacts/"
    prediction_logs = "prediction-logs/"
    batch_outputs   = "batch-outputs/"
    job_results     = "job-results/"
  }
}

resource "aws_s3_bucket" "artifacts" {
  #checkov:skip=CKV_AWS_144:Cross-region replication doubles storage cost; artifacts can be re-pushed from their source. Add a replication rule per deployment if the region itself must be survived.
  #checkov:skip=CKV2_AWS_62:Nothing consumes bucket events: Ember learns of artifacts through its registry API, not S3 notifications.
  bucket        = local.bucket_name
  force_destroy = var.force_destroy
  tags          = merge(var.tags, { Name = local.bucket_name })
}

resource "aws_s3_bucket_ownership_controls" "artifacts" {
  bucket = aws_s3_bucket.artifacts.id
  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "artifacts" {
  bucket                  = aws_s3_bucket.artifacts.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_versioning" "artifacts" {
  bucket = aws_s3_bucket.artifacts.id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "artifacts" {
  bucket = aws_s3_bucket.artifacts.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.this.arn
    }
    # Bucket keys cut KMS requests (and their cost) when replicas stream weights.
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_logging" "artifacts" {
  bucket        = aws_s3_bucket.artifacts.id
  target_bucket = aws_s3_bucket.access_logs.id
  target_prefix = "artifacts-bucket/"
  # S3 refuses a log target whose policy does not yet admit the logging service.
  depends_on = [aws_s3_bucket_policy.access_logs]
}

resource "aws_s3_bucket_lifecycle_configuration" "artifacts" {
  bucket = aws_s3_bucket.artifacts.id

  rule {
    id     = "expire-prediction-logs"
    status = "Enabled"
    filter {
      prefix = local.prefixes.prediction_logs
    }
    expiration {
      days = var.prediction_log_retention_days
    }
    noncurrent_version_expiration {
      noncurrent_days = 1
    }
  }

  rule {
    id     = "expire-batch-outputs"
    status = "Enabled"
    filter {
      prefix = local.prefixes.batch_outputs
    }
    expiration {
      days = var.batch_output_retention_days
    }
    noncurrent_version_expiration {
      noncurrent_days = 1
    }
  }

  rule {
    id     = "expire-job-results"
    status = "Enabled"
    filter {
      prefix = local.prefixes.job_results
    }
    expiration {
      days = var.job_result_retention_days
    }
    noncurrent_version_expiration {
      noncurrent_days = 1
    }
  }

  # Artifacts never expire; their overwritten or deleted versions do.
  rule {
    id     = "expire-noncurrent-versions"
    status = "Enabled"
    filter {}
    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_retention_days
    }
    abort_incomplete_multipart_upload {
      days_after_initiation = 7
    }
  }

  depends_on = [aws_s3_bucket_versioning.artifacts]
}

resource "aws_s3_bucket_policy" "artifacts" {
  bucket = aws_s3_bucket.artifacts.id
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        Sid       = "DenyInsecureTransport"
        Effect    = "Deny"
        Principal = "*"
        Action    = "s3:*"
        Resource  = [aws_s3_bucket.artifacts.arn, "${aws_s3_bucket.artifacts.arn}/*"]
        Condition = { Bool = { "aws:SecureTransport" = "false" } }
      },
      {
        Sid       = "DenyTlsOlderThan12"
        Effect    = "Deny"
        Principal = "*"
        Action    = "s3:*"
        Resource  = [aws_s3_bucket.artifacts.arn, "${aws_s3_bucket.artifacts.arn}/*"]
        Condition = { NumericLessThan = { "s3:TlsVersion" = "1.2" } }
      },
    ]
  })
  # The public access block must exist first, or a racing policy could be public.
  depends_on = [aws_s3_bucket_public_access_block.artifacts]
}
