output "app_secret_arn" {
  description = "Secrets Manager secret with EMBER_DATABASE_URL, EMBER_REDIS_URL and EMBER_ADMIN_KEY (JSON object)."
  value       = aws_secretsmanager_secret.app.arn
}

output "app_secret_name" {
  description = "Name of the app secret."
  value       = aws_secretsmanager_secret.app.name
}

output "postgres_address" {
  description = "Host name of the registry database."
  value       = aws_db_instance.this.address
}

output "postgres_port" {
  description = "Port of the registry database."
  value       = aws_db_instance.this.port
}

output "postgres_database_name" {
  description = "Database holding Ember's registry."
  value       = var.postgres_database_name
}

output "postgres_instance_id" {
  description = "RDS instance identifier."
  value       = aws_db_instance.this.identifier
}

output "redis_primary_endpoint" {
  description = "Primary endpoint of the Redis replication group (null when an external Redis is used)."
  value       = var.create_redis ? aws_elasticache_replication_group.this[0].primary_endpoint_address : null
}

output "postgres_security_group_id" {
  description = "Security group of the database."
  value       = aws_security_group.postgres.id
}

output "redis_security_group_id" {
  description = "Security group of the Redis nodes (null when an external Redis is used)."
  value       = var.create_redis ? aws_security_group.redis[0].id : null
}
