variable "name" {
  description = "Name prefix of every resource."
  type        = string
}

variable "bucket_name" {
  description = "Artifact bucket name. Null: \"<name>-artifacts-<account id>\" (bucket names are global)."
  type        = string
  default     = null
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete non-empty buckets and ECR repositories. Keep false in production: it deletes every model artifact."
  type        = bool
  default     = false
}

variable "prediction_log_retention_days" {
  description = "Days after which objects under prediction-logs/ expire."
  type        = number
  default     = 90

  validation {
    condition     = var.prediction_log_retention_days >= 1
    error_message = "prediction_log_retention_days must be at least 1."
  }
}

variable "batch_output_retention_days" {
  description = "Days after which objects under batch-outputs/ expire."
  type        = number
  default     = 30

  validation {
    condition     = var.batch_output_retention_days >= 1
    error_message = "batch_output_retention_days must be at least 1."
  }
}

variable "job_result_retention_days" {
  description = "Days after which objects under job-results/ expire."
  type        = number
  default     = 14

  validation {
    condition     = var.job_result_retention_days >= 1
    error_message = "job_result_retention_days must be at least 1."
  }
}

variable "noncurrent_version_retention_days" {
  description = "Days an overwritten or deleted object version is kept before it expires."
  type        = number
  default     = 30
}

variable "access_log_retention_days" {
  description = "Days S3 server access logs of the artifact bucket are kept."
  type        = number
  default     = 365
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
