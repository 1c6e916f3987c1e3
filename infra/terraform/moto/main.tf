# Harness that applies the Ember modules for real against a local moto server
# (infra/check.sh starts moto, runs apply, verify.py and destroy). Not for AWS.

terraform {
  required_version = ">= 1.11.0"

  # check.sh keeps the state in its temp dir: terraform init -backend-config=path=...
  backend "local" {}
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.95.0, < 6.0.0"
    }
  }
}

variable "endpoint" {
  description = "URL of the moto server, e.g. http://127.0.0.1:5000."
  type        = string
}

variable "create_redis" {
  description = "Apply the ElastiCache replication group too (moto cannot: see README)."
  type        = bool
  default     = false
}

variable "create_cluster" {
  description = "Apply the EKS module too."
  type        = bool
  default     = true
}

provider "aws" {
  region                      = "us-east-1"
  access_key                  = "testing"
  secret_key                  = "testing"
  skip_credentials_validation = true
  skip_metadata_api_check     = true
  skip_region_validation      = true
  s3_use_path_style           = true

  endpoints {
    autoscaling    = var.endpoint
    cloudwatchlogs = var.endpoint
    ec2            = var.endpoint
    ecr            = var.endpoint
    eks            = var.endpoint
    elasticache    = var.endpoint
    iam            = var.endpoint
    kms            = var.endpoint
    rds            = var.endpoint
    s3             = var.endpoint
    secretsmanager = var.endpoint
    sts            = var.endpoint
  }
}

locals {
  name = "ember-moto"
}

module "storage" {
  source        = "../modules/storage"
  name          = local.name
  force_destroy = true
}

module "network" {
  source             = "../modules/network"
  name               = local.name
  availability_zones = ["us-east-1a", "us-east-1b"]
  kms_key_arn        = module.storage.kms_key_arn
}

module "cluster" {
  count       = var.create_cluster ? 1 : 0
  source      = "../modules/cluster"
  name        = local.name
  vpc_id      = module.network.vpc_id
  subnet_ids  = module.network.private_subnet_ids
  kms_key_arn = module.storage.kms_key_arn
  # moto has no EKS add-on API (CreateAddon answers 404).
  manage_addons = false
}

# Stand-in for the EKS cluster security group when the cluster module is not applied.
resource "aws_security_group" "clients" {
  name        = "${local.name}-clients"
  description = "Stand-in for the EKS cluster security group"
  vpc_id      = module.network.vpc_id
}

module "data" {
  source                         = "../modules/data"
  name                           = local.name
  vpc_id                         = module.network.vpc_id
  subnet_ids                     = module.network.private_subnet_ids
  client_security_group_ids      = [aws_security_group.clients.id]
  kms_key_arn                    = module.storage.kms_key_arn
  deletion_protection            = false
  secret_recovery_window_days    = 0
  postgres_multi_az              = false
  postgres_monitoring_interval_s = 0
  create_redis                   = var.create_redis
  external_redis_url             = var.create_redis ? null : "rediss://:moto-cannot-run-elasticache@redis.invalid:6379/0"
}

module "iam" {
  source            = "../modules/iam"
  name              = local.name
  oidc_provider_arn = var.create_cluster ? module.cluster[0].oidc_provider_arn : aws_iam_openid_connect_provider.standin[0].arn
  oidc_issuer_url   = var.create_cluster ? module.cluster[0].oidc_issuer_url : aws_iam_openid_connect_provider.standin[0].url
  bucket_arn        = module.storage.bucket_arn
  kms_key_arn       = module.storage.kms_key_arn
  prefixes          = module.storage.prefixes
}

resource "aws_iam_openid_connect_provider" "standin" {
  count          = var.create_cluster ? 0 : 1
  url            = "https://oidc.eks.us-east-1.amazonaws.com/id/EMBERMOTO"
  client_id_list = ["sts.amazonaws.com"]
}

output "bucket_name" {
  value = module.storage.bucket_name
}
output "kms_key_arn" {
  value = module.storage.kms_key_arn
}
output "role_arns" {
  value = module.iam.role_arns
}
output "app_secret_arn" {
  value = module.data.app_secret_arn
}
output "postgres_instance_id" {
  value = module.data.postgres_instance_id
}
output "vpc_id" {
  value = module.network.vpc_id
}
output "cluster_name" {
  value = var.create_cluster ? module.cluster[0].cluster_name : null
}
output "ecr_repository_url" {
  value = module.storage.ecr_repository_url
}
