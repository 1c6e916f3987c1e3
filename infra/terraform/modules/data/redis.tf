# ElastiCache Redis: Celery broker/result backend and Ember's shared caches.
# TLS in transit, AUTH token, encryption at rest with the deployment key.

# ElastiCache has no write-only AUTH argument (provider 5.x), so this token is in the
# state: keep the state in an encrypted, access-controlled backend (README). It is drawn
# once per credentials_version and then frozen (local.generated changes on every run).
resource "terraform_data" "redis_auth_token" {
  count            = var.create_redis ? 1 : 0
  input            = local.generated.redis_auth_token
  triggers_replace = [var.credentials_version]

  lifecycle {
    ignore_changes = [input]
  }
}

resource "aws_security_group" "redis" {
  count       = var.create_redis ? 1 : 0
  name        = "${var.name}-redis"
  description = "Ember Redis: reachable from the cluster only"
  vpc_id      = var.vpc_id
  tags        = merge(var.tags, { Name = "${var.name}-redis" })
}

resource "aws_vpc_security_group_ingress_rule" "redis" {
  count                        = var.create_redis ? length(var.client_security_group_ids) : 0
  security_group_id            = aws_security_group.redis[0].id
  description                  = "Redis from Ember pods and nodes"
  ip_protocol                  = "tcp"
  from_port                    = 6379
  to_port                      = 6379
  referenced_security_group_id = var.client_security_group_ids[count.index]
}

resource "aws_elasticache_subnet_group" "this" {
  count       = var.create_redis ? 1 : 0
  name        = "${var.name}-redis"
  description = "Private subnets of the Ember Redis"
  subnet_ids  = var.subnet_ids
  tags        = var.tags
}

resource "aws_elasticache_replication_group" "this" {
  count                = var.create_redis ? 1 : 0
  replication_group_id = "${var.name}-redis"
  description          = "Ember job queue and shared caches"
  engine               = "redis"
  engine_version       = var.redis_engine_version
  node_type            = var.redis_node_type
  port                 = 6379
  parameter_group_name = "default.redis7"

  num_cache_clusters         = var.redis_num_cache_clusters
  automatic_failover_enabled = true
  multi_az_enabled           = true
  subnet_group_name          = aws_elasticache_subnet_group.this[0].name
  security_group_ids         = [aws_security_group.redis[0].id]

  at_rest_encryption_enabled = true
  kms_key_id                 = var.kms_key_arn
  transit_encryption_enabled = true
  auth_token                 = terraform_data.redis_auth_token[0].output
  auth_token_update_strategy = "ROTATE"

  snapshot_retention_limit   = var.redis_snapshot_retention_days
  snapshot_window            = "02:00-03:00"
  maintenance_window         = "sun:05:30-sun:06:30"
  auto_minor_version_upgrade = true
  apply_immediately          = true

  tags = var.tags
}
