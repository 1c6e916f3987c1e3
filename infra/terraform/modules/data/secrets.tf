# One Secrets Manager secret holds every credential Ember needs, as environment
# variables: EMBER_DATABASE_URL, EMBER_REDIS_URL and EMBER_ADMIN_KEY. It is written
# through write-only arguments, so none of it lands in the plan; deploy/k8s turns it
# into the Kubernetes Secret `ember-secrets`.

locals {
  redis_url = var.create_redis ? format(
    "rediss://:%s@%s:6379/0",
    terraform_data.redis_auth_token[0].output,
    aws_elasticache_replication_group.this[0].primary_endpoint_address,
  ) : var.external_redis_url
}

resource "aws_secretsmanager_secret" "app" {
  #checkov:skip=CKV2_AWS_57:Rotation is by Terraform, not a rotation Lambda: bump credentials_version and apply, which rewrites the RDS password, the Redis AUTH token and this secret together (README, "Rotate credentials").
  name                    = "${var.name}/ember-app"
  description             = "Ember process environment: EMBER_DATABASE_URL, EMBER_REDIS_URL, EMBER_ADMIN_KEY"
  kms_key_id              = var.kms_key_arn
  recovery_window_in_days = var.secret_recovery_window_days
  tags                    = var.tags
}

resource "aws_secretsmanager_secret_version" "app" {
  secret_id = aws_secretsmanager_secret.app.id
  secret_string_wo = jsonencode({
    EMBER_DATABASE_URL = format(
      "postgresql+psycopg://%s:%s@%s:%d/%s?sslmode=require",
      var.postgres_username,
      local.db_password,
      aws_db_instance.this.address,
      aws_db_instance.this.port,
      var.postgres_database_name,
    )
    EMBER_REDIS_URL = local.redis_url
    EMBER_ADMIN_KEY = local.admin_key
  })
  secret_string_wo_version = var.credentials_version

  lifecycle {
    precondition {
      condition     = var.create_redis || var.external_redis_url != null
      error_message = "Set external_redis_url when create_redis is false."
    }

  }
}
