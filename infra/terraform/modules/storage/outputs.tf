output "bucket_name" {
  description = "Name of the artifact bucket."
  value       = aws_s3_bucket.artifacts.bucket
}

output "bucket_arn" {
  description = "ARN of the artifact bucket."
  value       = aws_s3_bucket.artifacts.arn
}

output "prefixes" {
  description = "Object prefixes Ember writes to (artifacts, prediction_logs, batch_outputs, job_results), each ending in \"/\"."
  value       = local.prefixes
}

output "object_store_url" {
  description = "EMBER_OBJECT_STORE_URL: where `ember models push` puts artifacts."
  value       = "s3://${aws_s3_bucket.artifacts.bucket}/${trimsuffix(local.prefixes.artifacts, "/")}"
}

output "access_log_bucket_name" {
  description = "Bucket receiving the artifact bucket's server access logs."
  value       = aws_s3_bucket.access_logs.bucket
}

output "kms_key_arn" {
  description = "ARN of the deployment's customer-managed KMS key."
  value       = aws_kms_key.this.arn
}

output "ecr_repository_url" {
  description = "ECR repository to push the Ember image to."
  value       = aws_ecr_repository.ember.repository_url
}
