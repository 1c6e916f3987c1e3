output "vpc_id" {
  description = "Id of the VPC everything runs in."
  value       = local.create ? aws_vpc.this[0].id : var.existing_vpc.vpc_id
}

output "vpc_cidr_block" {
  description = "CIDR of a VPC this module created (null for an existing VPC)."
  value       = local.create ? aws_vpc.this[0].cidr_block : null
}

output "private_subnet_ids" {
  description = "Private subnets (one per AZ) for nodes, RDS and ElastiCache."
  value       = local.create ? aws_subnet.private[*].id : var.existing_vpc.private_subnet_ids
}

output "public_subnet_ids" {
  description = "Public subnets holding the NAT gateway(s) and internet-facing load balancers."
  value       = aws_subnet.public[*].id
}

output "availability_zones" {
  description = "AZs of the private subnets this module created."
  value       = local.azs
}
