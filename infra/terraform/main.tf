# Ember on AWS: network -> storage (KMS, S3, ECR) -> cluster (EKS, NVMe GPU nodes)
# -> data (RDS PostgreSQL, ElastiCache Redis, app secret) -> iam (IRSA roles).

module "storage" {
  source = "./modules/storage"

  name                          = var.name
  bucket_name                   = var.bucket_name
  force_destroy                 = var.force_destroy
  prediction_log_retention_days = var.prediction_log_retention_days
  batch_output_retention_days   = var.batch_output_retention_days
  job_result_retention_days     = var.job_result_retention_days
}

module "network" {
  source = "./modules/network"

  name               = var.name
  existing_vpc       = var.existing_vpc
  cidr_block         = var.vpc_cidr
  az_count           = var.az_count
  single_nat_gateway = var.single_nat_gateway
  kms_key_arn        = module.storage.kms_key_arn
}

module "cluster" {
  source = "./modules/cluster"

  name                 = var.name
  kubernetes_version   = var.kubernetes_version
  vpc_id               = module.network.vpc_id
  subnet_ids           = module.network.private_subnet_ids
  kms_key_arn          = module.storage.kms_key_arn
  public_access_cidrs  = var.public_access_cidrs
  admin_principal_arns = var.admin_principal_arns
  cpu_node_group       = var.cpu_node_group
  gpu_node_groups      = var.gpu_node_groups
  cache_dir            = var.cache_dir
}

module "data" {
  source = "./modules/data"

  name                           = var.name
  vpc_id                         = module.network.vpc_id
  subnet_ids                     = module.network.private_subnet_ids
  client_security_group_ids      = [module.cluster.cluster_security_group_id]
  kms_key_arn                    = module.storage.kms_key_arn
  postgres_instance_class        = var.postgres_instance_class
  postgres_multi_az              = var.postgres_multi_az
  postgres_backup_retention_days = var.postgres_backup_retention_days
  deletion_protection            = var.deletion_protection
  redis_node_type                = var.redis_node_type
  redis_num_cache_clusters       = var.redis_num_cache_clusters
  credentials_version            = var.credentials_version
}

module "iam" {
  source = "./modules/iam"

  name              = var.name
  namespace         = var.namespace
  oidc_provider_arn = module.cluster.oidc_provider_arn
  oidc_issuer_url   = module.cluster.oidc_issuer_url
  bucket_arn        = module.storage.bucket_arn
  kms_key_arn       = module.storage.kms_key_arn
  prefixes          = module.storage.prefixes
}

locals {
  # Non-secret settings of every Ember process (ConfigMap `ember-config`). The secret
  # ones (EMBER_DATABASE_URL, EMBER_REDIS_URL, EMBER_ADMIN_KEY) are in the app secret.
  ember_config = {
    EMBER_OBJECT_STORE_URL   = module.storage.object_store_url
    EMBER_S3_ALLOWED_BUCKETS = join(",", distinct(concat([module.storage.bucket_name], var.extra_allowed_buckets)))
    EMBER_S3_REGION          = var.region
    EMBER_CACHE_DIR          = var.cache_dir
    EMBER_CACHE_MAX_BYTES    = tostring(var.cache_max_bytes)
    EMBER_DATA_DIR           = "/var/lib/ember"
    EMBER_HOST               = "0.0.0.0"
    EMBER_PORT               = "8000"
    EMBER_LOG_FORMAT         = "json"
  }

  # Values deploy/k8s substitutes into its manifests (ConfigMap `ember-infra`, which
  # kustomize `replacements` read; no process sees it).
  infra_config = {
    API_ROLE_ARN    = module.iam.role_arns["api"]
    WORKER_ROLE_ARN = module.iam.role_arns["worker"]
    ENGINE_ROLE_ARN = module.iam.role_arns["replica"]
    CLUSTER_NAME    = module.cluster.cluster_name
    AWS_REGION      = var.region
    APP_SECRET_ARN  = module.data.app_secret_arn
    # The GPU types of the node groups: the hardware types that keep standby pods
    # (EMBER_K8S_STANDBY_ACCELERATORS of the API pods, which run the pools controller).
    GPU_TYPES = join(",", sort(distinct([for g in var.gpu_node_groups : g.gpu_type])))
  }
}
