output "ember_config" {
  description = "Non-secret EMBER_* settings for every Ember process."
  value       = local.ember_config
}

output "ember_config_env" {
  description = "ember_config as KEY=VALUE lines: deploy/k8s/overlays/aws/ember-config.env."
  value       = join("", [for k in sort(keys(local.ember_config)) : "${k}=${local.ember_config[k]}\n"])
}

output "infra_env" {
  description = "IRSA role ARNs and cluster facts as KEY=VALUE lines: deploy/k8s/overlays/aws/ember-infra.env."
  value       = join("", [for k in sort(keys(local.infra_config)) : "${k}=${local.infra_config[k]}\n"])
}

output "app_secret_arn" {
  description = "Secrets Manager secret holding EMBER_DATABASE_URL, EMBER_REDIS_URL and EMBER_ADMIN_KEY."
  value       = module.data.app_secret_arn
}

output "region" {
  description = "AWS region of the deployment."
  value       = var.region
}

output "cluster_name" {
  description = "EKS cluster name."
  value       = module.cluster.cluster_name
}

output "kubeconfig_command" {
  description = "Command that points kubectl at the cluster."
  value       = "aws eks update-kubeconfig --region ${var.region} --name ${module.cluster.cluster_name}"
}

output "ecr_repository_url" {
  description = "Push the Ember image here."
  value       = module.storage.ecr_repository_url
}

output "bucket_name" {
  description = "Artifact bucket."
  value       = module.storage.bucket_name
}

output "role_arns" {
  description = "IRSA role ARN by process kind."
  value       = module.iam.role_arns
}

output "gpu_node_labels" {
  description = "Node labels of each GPU node group (the pools controller places replicas by ember.dev/accelerator)."
  value       = module.cluster.gpu_node_labels
}

output "postgres_address" {
  description = "Registry database host."
  value       = module.data.postgres_address
}

output "redis_primary_endpoint" {
  description = "Redis primary endpoint."
  value       = module.data.redis_primary_endpoint
}
