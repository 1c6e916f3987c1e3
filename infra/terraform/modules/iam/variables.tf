variable "name" {
  description = "Name prefix of every role."
  type        = string
}

variable "oidc_provider_arn" {
  description = "ARN of the cluster's IAM OIDC provider."
  type        = string
}

variable "oidc_issuer_url" {
  description = "Issuer URL of the cluster's OIDC provider (https://oidc.eks.<region>.amazonaws.com/id/...)."
  type        = string
}

variable "namespace" {
  description = "Kubernetes namespace Ember runs in."
  type        = string
  default     = "ember"
}

variable "bucket_arn" {
  description = "ARN of the artifact bucket."
  type        = string
}

variable "kms_key_arn" {
  description = "KMS key encrypting the artifact bucket."
  type        = string
}

variable "prefixes" {
  description = "Object prefixes in the bucket, each ending in \"/\" (modules/storage output `prefixes`)."
  type = object({
    artifacts       = string
    prediction_logs = string
    batch_outputs   = string
    job_results     = string
  })
  default = {
    artifacts       = "artifacts/"
    prediction_logs = "prediction-logs/"
    batch_outputs   = "batch-outputs/"
    job_results     = "job-results/"
  }

  validation {
    condition     = alltrue([for p in values(var.prefixes) : can(regex("^[a-z0-9][a-z0-9-]*/$", p))])
    error_message = "Each prefix must be a single lowercase path segment ending in \"/\"."
  }
}

variable "tags" {
  description = "Tags added to every role."
  type        = map(string)
  default     = {}
}
