variable "name" {
  description = "Deployment name: prefix of every resource and the EKS cluster name."
  type        = string
  default     = "ember"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,22}$", var.name))
    error_message = "name must be 2-23 lowercase letters, digits or hyphens, starting with a letter."
  }
}

variable "region" {
  description = "AWS region. Pick one that sells your GPU instance types (g6e: us-east-1, us-east-2, us-west-2, eu-west-1, ...)."
  type        = string
  default     = "us-east-1"
}

variable "tags" {
  description = "Tags added to every resource (on top of app.kubernetes.io/part-of=ember)."
  type        = map(string)
  default     = {}
}

# --- network ------------------------------------------------------------------------

variable "existing_vpc" {
  description = "Use this VPC and its private subnets (>= 2 AZs) instead of creating one. See modules/network."
  type = object({
    vpc_id             = string
    private_subnet_ids = list(string)
  })
  default = null
}

variable "vpc_cidr" {
  description = "CIDR of a new VPC."
  type        = string
  default     = "10.40.0.0/16"
}

variable "az_count" {
  description = "AZs a new VPC spans (>= 2)."
  type        = number
  default     = 3
}

variable "single_nat_gateway" {
  description = "One NAT gateway for the whole VPC (cheaper) instead of one per AZ."
  type        = bool
  default     = true
}

# --- storage ------------------------------------------------------------------------

variable "bucket_name" {
  description = "Artifact bucket name. Null: \"<name>-artifacts-<account id>\"."
  type        = string
  default     = null
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete non-empty buckets and the ECR repository (every artifact and image). Only for throwaway deployments."
  type        = bool
  default     = false
}

variable "prediction_log_retention_days" {
  description = "Days prediction logs are kept in the bucket."
  type        = number
  default     = 90
}

variable "batch_output_retention_days" {
  description = "Days batch outputs are kept in the bucket."
  type        = number
  default     = 30
}

variable "job_result_retention_days" {
  description = "Days async job results are kept in the bucket."
  type        = number
  default     = 14
}

# --- data ---------------------------------------------------------------------------

variable "postgres_instance_class" {
  description = "RDS instance class of the registry."
  type        = string
  default     = "db.m7g.large"
}

variable "postgres_multi_az" {
  description = "Synchronous standby in a second AZ."
  type        = bool
  default     = true
}

variable "postgres_backup_retention_days" {
  description = "Days of automated database backups."
  type        = number
  default     = 7
}

variable "deletion_protection" {
  description = "Protect the database from deletion (turn off, apply, then destroy to tear down)."
  type        = bool
  default     = true
}

variable "redis_node_type" {
  description = "ElastiCache node type."
  type        = string
  default     = "cache.m7g.large"
}

variable "redis_num_cache_clusters" {
  description = "Redis nodes (primary + replicas); 2+ gives automatic failover."
  type        = number
  default     = 2
}

variable "credentials_version" {
  description = "Bump to rotate the database password, Redis AUTH token and Ember admin key."
  type        = number
  default     = 1
}

# --- cluster ------------------------------------------------------------------------

variable "kubernetes_version" {
  description = "EKS Kubernetes version."
  type        = string
  default     = "1.31"
}

variable "public_access_cidrs" {
  description = "CIDRs that may reach the Kubernetes API from the internet. Empty: private endpoint only."
  type        = list(string)
  default     = []
}

variable "admin_principal_arns" {
  description = "IAM principals made cluster admins (the creator already is)."
  type        = list(string)
  default     = []
}

variable "cpu_node_group" {
  description = "CPU node group for api (with the pools controller), workers and beat. See modules/cluster."
  type = object({
    instance_types = list(string)
    min_size       = number
    desired_size   = number
    max_size       = number
    disk_size_gb   = number
  })
  default = {
    instance_types = ["m7i.xlarge"]
    min_size       = 2
    desired_size   = 2
    max_size       = 6
    disk_size_gb   = 100
  }
}

variable "gpu_node_groups" {
  description = "GPU node groups with local NVMe, keyed by name. See modules/cluster."
  type = map(object({
    instance_types = list(string)
    gpu_type       = string
    gpus_per_node  = number
    min_size       = number
    desired_size   = number
    max_size       = number
    capacity_type  = optional(string, "ON_DEMAND")
    disk_size_gb   = optional(number, 200)
  }))
  default = {
    l40s = {
      instance_types = ["g6e.xlarge", "g6e.2xlarge"]
      gpu_type       = "nvidia-l40s"
      gpus_per_node  = 1
      min_size       = 1
      desired_size   = 1
      max_size       = 4
    }
  }
}

# --- Ember --------------------------------------------------------------------------

variable "namespace" {
  description = "Kubernetes namespace of Ember (the IRSA roles trust service accounts there)."
  type        = string
  default     = "ember"
}

variable "cache_dir" {
  description = "Weight cache on the GPU nodes' NVMe: EMBER_CACHE_DIR of replicas."
  type        = string
  default     = "/mnt/nvme/ember-cache"
}

variable "cache_max_bytes" {
  description = "EMBER_CACHE_MAX_BYTES: byte budget of the weight cache; keep it below the smallest NVMe of your GPU types (g6e.xlarge: 250 GB)."
  type        = number
  default     = 200 * 1024 * 1024 * 1024
}

variable "extra_allowed_buckets" {
  description = "Other buckets Ember may load s3:// artifacts from (EMBER_S3_ALLOWED_BUCKETS). The IRSA roles do not grant them: add a bucket policy there."
  type        = list(string)
  default     = []
}
