output "role_arns" {
  description = "IRSA role ARN by process kind (api, worker, replica): the eks.amazonaws.com/role-arn annotation of each service account."
  value       = { for k, r in aws_iam_role.this : k => r.arn }
}

output "service_accounts" {
  description = "Kubernetes service account each role trusts, by process kind."
  value       = { for k, r in local.roles : k => r.service_account }
}

output "policies" {
  description = "The permission policy document of each role (decoded), for review and tests."
  value       = local.policies
}
