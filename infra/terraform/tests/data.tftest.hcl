# RDS PostgreSQL and ElastiCache Redis: encrypted, private, backed up, protected,
# credentials only in Secrets Manager (never in the Terraform state).

mock_provider "aws" {
  source = "./tests/mocks"
}

variables {
  name                      = "ember-test"
  vpc_id                    = "vpc-0123456789abcdef0"
  subnet_ids                = ["subnet-aaaa", "subnet-bbbb"]
  client_security_group_ids = ["sg-0eks"]
  kms_key_arn               = "arn:aws:kms:us-east-1:123456789012:key/11111111-2222-3333-4444-555555555555"
}

run "postgres_is_encrypted_private_and_protected" {
  command = apply

  module {
    source = "./modules/data"
  }

  assert {
    condition     = aws_db_instance.this.storage_encrypted && aws_db_instance.this.kms_key_id == var.kms_key_arn
    error_message = "The database must be encrypted with the deployment key."
  }

  assert {
    condition     = !aws_db_instance.this.publicly_accessible
    error_message = "The database must not be publicly accessible."
  }

  assert {
    condition     = aws_db_instance.this.deletion_protection && !aws_db_instance.this.skip_final_snapshot
    error_message = "Deletion protection and a final snapshot must be on by default."
  }

  assert {
    condition     = aws_db_instance.this.backup_retention_period >= 7
    error_message = "Automated backups must be kept at least 7 days by default."
  }

  assert {
    condition     = aws_db_instance.this.multi_az
    error_message = "Multi-AZ must be on by default."
  }

  assert {
    condition = anytrue([
      for p in aws_db_parameter_group.this.parameter : p.name == "rds.force_ssl" && p.value == "1"
    ])
    error_message = "PostgreSQL must refuse connections without TLS (rds.force_ssl = 1)."
  }

  assert {
    condition     = aws_db_instance.this.performance_insights_kms_key_id == var.kms_key_arn
    error_message = "Performance Insights data must be encrypted with the deployment key."
  }

  assert {
    condition = (
      length(aws_vpc_security_group_ingress_rule.postgres) == 1
      && aws_vpc_security_group_ingress_rule.postgres[0].referenced_security_group_id == "sg-0eks"
      && aws_vpc_security_group_ingress_rule.postgres[0].from_port == 5432
      && aws_vpc_security_group_ingress_rule.postgres[0].cidr_ipv4 == null
    )
    error_message = "Only the cluster security group may reach PostgreSQL, and only on 5432."
  }
}

run "credentials_never_reach_the_state" {
  command = apply

  module {
    source = "./modules/data"
  }

  assert {
    condition     = aws_db_instance.this.password == null && aws_db_instance.this.password_wo == null
    error_message = "The database password must go through the write-only argument, never into the state."
  }

  assert {
    condition     = aws_db_instance.this.password_wo_version == var.credentials_version
    error_message = "The password must be (re)sent when credentials_version changes."
  }

  assert {
    condition     = aws_secretsmanager_secret_version.app.secret_string == null && aws_secretsmanager_secret_version.app.secret_string_wo == null
    error_message = "The app secret must be written through the write-only argument."
  }

  assert {
    condition     = aws_secretsmanager_secret.app.kms_key_id == var.kms_key_arn
    error_message = "The app secret must be encrypted with the deployment key."
  }
}

run "redis_has_tls_auth_and_encryption_at_rest" {
  command = apply

  module {
    source = "./modules/data"
  }

  assert {
    condition     = aws_elasticache_replication_group.this[0].transit_encryption_enabled
    error_message = "Redis must use TLS in transit."
  }

  assert {
    condition     = aws_elasticache_replication_group.this[0].at_rest_encryption_enabled && aws_elasticache_replication_group.this[0].kms_key_id == var.kms_key_arn
    error_message = "Redis must be encrypted at rest with the deployment key."
  }

  assert {
    condition     = length(nonsensitive(aws_elasticache_replication_group.this[0].auth_token)) >= 32
    error_message = "Redis must require a long AUTH token."
  }

  assert {
    condition     = aws_elasticache_replication_group.this[0].automatic_failover_enabled && aws_elasticache_replication_group.this[0].multi_az_enabled
    error_message = "Two Redis nodes by default, with automatic failover across AZs."
  }

  assert {
    condition     = aws_elasticache_replication_group.this[0].snapshot_retention_limit >= 1
    error_message = "Redis snapshots must be kept."
  }
}

run "auth_token_is_stable_across_plans" {
  command = plan

  module {
    source = "./modules/data"
  }

  # The data source yields a fresh random value on every plan; terraform_data freezes it.
  assert {
    condition     = length(terraform_data.redis_auth_token) == 1
    error_message = "The Redis AUTH token must be frozen in terraform_data."
  }
}

run "backups_cannot_be_turned_off" {
  command = plan

  module {
    source = "./modules/data"
  }

  variables {
    postgres_backup_retention_days = 0
  }

  expect_failures = [var.postgres_backup_retention_days]
}

run "external_redis_needs_a_url" {
  command = plan

  module {
    source = "./modules/data"
  }

  variables {
    create_redis = false
  }

  expect_failures = [aws_secretsmanager_secret_version.app]
}

run "redis_needs_a_replica" {
  command = plan

  module {
    source = "./modules/data"
  }

  variables {
    redis_num_cache_clusters = 1
  }

  expect_failures = [var.redis_num_cache_clusters]
}
