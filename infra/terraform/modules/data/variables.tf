variable "name" {
  description = "Name prefix of every resource (lowercase letters, digits and hyphens)."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}$", var.name))
    error_message = "name must be 2-31 lowercase letters, digits or hyphens, starting with a letter (ElastiCache and RDS identifiers derive from it)."
  }
}

variable "vpc_id" {
  description = "VPC of the database and cache."
  type        = string
}

variable "subnet_ids" {
  description = "Private subnets (two AZs or more) for RDS and ElastiCache."
  type        = list(string)

  validation {
    condition     = length(var.subnet_ids) >= 2
    error_message = "RDS and ElastiCache subnet groups need subnets in at least two AZs."
  }
}

variable "client_security_group_ids" {
  description = "Security groups allowed to connect to PostgreSQL (5432) and Redis (6379): the EKS cluster/node security group."
  type        = list(string)
}

variable "kms_key_arn" {
  description = "Customer-managed KMS key for storage, Performance Insights and the app secret."
  type        = string
}

variable "credentials_version" {
  description = "Bump to generate a new database password, Redis AUTH token and Ember admin key on the next apply (rotation)."
  type        = number
  default     = 1
}

# --- PostgreSQL ---------------------------------------------------------------------

variable "postgres_engine_version" {
  description = "RDS PostgreSQL major (or major.minor) version."
  type        = string
  default     = "16"
}

variable "postgres_instance_class" {
  description = "RDS instance class of the registry database."
  type        = string
  default     = "db.m7g.large"
}

variable "postgres_allocated_storage_gb" {
  description = "Initial gp3 storage of the database, in GiB."
  type        = number
  default     = 50
}

variable "postgres_max_allocated_storage_gb" {
  description = "Storage autoscaling ceiling, in GiB."
  type        = number
  default     = 500
}

variable "postgres_multi_az" {
  description = "Run a synchronous standby in a second AZ (doubles the instance cost)."
  type        = bool
  default     = true
}

variable "postgres_backup_retention_days" {
  description = "Days of automated backups (point-in-time recovery window)."
  type        = number
  default     = 7

  validation {
    condition     = var.postgres_backup_retention_days >= 1 && var.postgres_backup_retention_days <= 35
    error_message = "postgres_backup_retention_days must be 1-35: backups cannot be turned off."
  }
}

variable "deletion_protection" {
  description = "Refuse to delete the database (and take a final snapshot when it is deleted). Turn off only to tear down."
  type        = bool
  default     = true
}

variable "postgres_database_name" {
  description = "Database that holds Ember's registry."
  type        = string
  default     = "ember"
}

variable "postgres_username" {
  description = "Master user Ember connects as."
  type        = string
  default     = "ember"
}

variable "postgres_monitoring_interval_s" {
  description = "Enhanced Monitoring interval in seconds (0 turns it off)."
  type        = number
  default     = 60
}

# --- Redis ----------------------------------------------------------------------------

variable "create_redis" {
  description = "Create the ElastiCache Redis replication group. False: pass external_redis_url instead."
  type        = bool
  default     = true
}

variable "external_redis_url" {
  description = "EMBER_REDIS_URL of a Redis Ember should use when create_redis is false (rediss:// with AUTH)."
  type        = string
  default     = null
  sensitive   = true
}

variable "redis_engine_version" {
  description = "ElastiCache Redis engine version."
  type        = string
  default     = "7.1"
}

variable "redis_node_type" {
  description = "ElastiCache node type."
  type        = string
  default     = "cache.m7g.large"
}

variable "redis_num_cache_clusters" {
  description = "Nodes in the replication group: 1 primary + replicas in other AZs, with automatic failover."
  type        = number
  default     = 2

  validation {
    condition     = var.redis_num_cache_clusters >= 2 && var.redis_num_cache_clusters <= 6
    error_message = "redis_num_cache_clusters must be 2-6: a lost primary must fail over to a replica, or queued jobs stall."
  }
}

variable "redis_snapshot_retention_days" {
  description = "Days of daily Redis snapshots."
  type        = number
  default     = 7
}

variable "secret_recovery_window_days" {
  description = "Days a deleted app secret can be restored (0 deletes at once; for test environments)."
  type        = number
  default     = 30
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
