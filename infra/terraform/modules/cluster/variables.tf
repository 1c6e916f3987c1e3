variable "name" {
  description = "Cluster name, also the name prefix of every resource."
  type        = string
}

variable "kubernetes_version" {
  description = "EKS Kubernetes version."
  type        = string
  default     = "1.31"
}

variable "vpc_id" {
  description = "VPC of the cluster."
  type        = string
}

variable "subnet_ids" {
  description = "Private subnets (two AZs or more) for the control plane ENIs and the nodes."
  type        = list(string)

  validation {
    condition     = length(var.subnet_ids) >= 2
    error_message = "EKS needs subnets in at least two AZs."
  }
}

variable "kms_key_arn" {
  description = "Customer-managed KMS key: Kubernetes secrets envelope encryption, node EBS volumes, control plane logs."
  type        = string
}

variable "public_access_cidrs" {
  description = <<-EOT
    CIDRs allowed to reach the Kubernetes API endpoint from the internet (e.g. your office
    or VPN egress). Empty: the endpoint is private, reachable from inside the VPC only.
    0.0.0.0/0 is refused.
  EOT
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for c in var.public_access_cidrs : can(cidrhost(c, 0)) && !endswith(c, "/0")])
    error_message = "public_access_cidrs must be valid CIDRs, none of them /0."
  }
}

variable "admin_principal_arns" {
  description = "IAM users/roles given cluster-admin through EKS access entries (besides whoever creates the cluster)."
  type        = list(string)
  default     = []
}

variable "manage_addons" {
  description = "Install and update the vpc-cni, kube-proxy and coredns EKS add-ons with Terraform."
  type        = bool
  default     = true
}

variable "log_retention_days" {
  description = "Days the control plane logs are kept."
  type        = number
  default     = 365
}

variable "cpu_node_group" {
  description = "Node group for the API (which runs the pools controller), Celery workers and beat."
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
  description = <<-EOT
    GPU node groups for model replicas, keyed by a short name. Every instance type must
    have local NVMe instance storage (g6e, g6, g5, p4d, p5 families): it is RAID-0'd,
    formatted and mounted at nvme_mount_path for Ember's weight cache. `gpu_type` becomes
    the node label ember.dev/accelerator, which the pools controller selects on; all
    instance types of one group must carry that GPU.
  EOT
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

  validation {
    condition = alltrue([
      for g in values(var.gpu_node_groups) : alltrue([
        for t in g.instance_types : can(regex("^(g4dn|g5|g6|g6e|gr6|p4d|p4de|p5|p5e|p5en)\\.", t))
      ])
    ])
    error_message = "GPU instance types must come from a family with local NVMe instance storage: g4dn, g5, g6, g6e, gr6, p4d, p4de, p5, p5e, p5en."
  }

  validation {
    condition     = alltrue([for g in values(var.gpu_node_groups) : contains(["ON_DEMAND", "SPOT"], g.capacity_type)])
    error_message = "capacity_type must be ON_DEMAND or SPOT."
  }
}

variable "nvme_mount_path" {
  description = "Where GPU nodes mount their local NVMe (RAID-0 over all instance-store disks)."
  type        = string
  default     = "/mnt/nvme"
}

variable "cache_dir" {
  description = "Ember's weight cache on the NVMe mount (EMBER_CACHE_DIR of replicas; a hostPath in deploy/k8s)."
  type        = string
  default     = "/mnt/nvme/ember-cache"

  validation {
    condition     = startswith(var.cache_dir, "/")
    error_message = "cache_dir must be an absolute path."
  }
}

variable "cache_owner_uid" {
  description = "UID the Ember containers run as (deploy/k8s securityContext); it owns the cache directory."
  type        = number
  default     = 10001
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
