variable "name" {
  description = "Name prefix of every resource (e.g. \"ember-prod\")."
  type        = string
}

variable "existing_vpc" {
  description = <<-EOT
    Use an existing VPC instead of creating one: its id and at least two private subnet
    ids in different availability zones (with a route to the internet through NAT, or
    VPC endpoints for ECR, S3, STS, EKS and Secrets Manager). Null creates a new VPC.
  EOT
  type = object({
    vpc_id             = string
    private_subnet_ids = list(string)
  })
  default = null

  validation {
    condition     = var.existing_vpc == null || try(length(var.existing_vpc.private_subnet_ids) >= 2, false)
    error_message = "An existing VPC needs at least two private subnets in different AZs."
  }
}

variable "cidr_block" {
  description = "CIDR of a new VPC. Private subnets take /19s from its lower half, public ones /24s from its upper half."
  type        = string
  default     = "10.40.0.0/16"

  validation {
    condition     = can(cidrhost(var.cidr_block, 0)) && tonumber(split("/", var.cidr_block)[1]) <= 16
    error_message = "cidr_block must be a valid IPv4 CIDR of /16 or larger."
  }
}

variable "availability_zones" {
  description = "AZs for a new VPC's subnets. Empty: the first az_count available zones of the region."
  type        = list(string)
  default     = []
}

variable "az_count" {
  description = "How many AZs a new VPC spans when availability_zones is empty (at least 2)."
  type        = number
  default     = 3

  validation {
    condition     = var.az_count >= 2 && var.az_count <= 6
    error_message = "az_count must be between 2 and 6: RDS, ElastiCache and EKS need two AZs or more."
  }
}

variable "single_nat_gateway" {
  description = "One NAT gateway for all AZs (cheaper) instead of one per AZ (survives an AZ outage)."
  type        = bool
  default     = true
}

variable "kms_key_arn" {
  description = "KMS key that encrypts the VPC flow log group."
  type        = string
}

variable "flow_log_retention_days" {
  description = "Days the VPC flow logs are kept."
  type        = number
  default     = 365
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
