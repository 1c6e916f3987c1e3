output "cluster_name" {
  description = "EKS cluster name (aws eks update-kubeconfig --name ...)."
  value       = aws_eks_cluster.this.name
}

output "cluster_endpoint" {
  description = "Kubernetes API endpoint."
  value       = aws_eks_cluster.this.endpoint
}

output "cluster_certificate_authority_data" {
  description = "Base64 CA bundle of the API endpoint."
  value       = aws_eks_cluster.this.certificate_authority[0].data
}

output "cluster_security_group_id" {
  description = "Security group EKS attaches to the control plane and managed nodes; RDS and Redis admit it."
  value       = aws_eks_cluster.this.vpc_config[0].cluster_security_group_id
}

output "oidc_provider_arn" {
  description = "IAM OIDC provider of the cluster (IRSA trust)."
  value       = aws_iam_openid_connect_provider.this.arn
}

output "oidc_issuer_url" {
  description = "OIDC issuer URL of the cluster."
  value       = aws_eks_cluster.this.identity[0].oidc[0].issuer
}

output "node_role_arn" {
  description = "IAM role of every node."
  value       = aws_iam_role.node.arn
}

output "gpu_node_labels" {
  description = "Labels each GPU node group puts on its nodes, by group key."
  value       = local.gpu_labels
}

output "cache_dir" {
  description = "Weight cache directory on the GPU nodes' NVMe (EMBER_CACHE_DIR of replicas)."
  value       = var.cache_dir
}

output "gpu_user_data" {
  description = "Rendered MIME user data of the GPU launch templates (NVMe format + mount)."
  value       = local.gpu_user_data
}
