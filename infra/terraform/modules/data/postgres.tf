# RDS PostgreSQL for Ember's registry. The master password (credentials.tf) goes
# through a write-only argument: it is never stored in the Terraform state or plan; the
# only copy is the app secret (secrets.tf).


resource "aws_security_group" "postgres" {
  name        = "${var.name}-postgres"
  description = "Ember registry PostgreSQL: reachable from the cluster only"
  vpc_id      = var.vpc_id
  tags        = merge(var.tags, { Name = "${var.name}-postgres" })
}

resource "aws_vpc_security_group_ingress_rule" "postgres" {
  count                        = length(var.client_security_group_ids)
  security_group_id            = aws_security_group.postgres.id
  description                  = "PostgreSQL from Ember pods and nodes"
  ip_protocol                  = "tcp"
  from_port                    = 5432
  to_port                      = 5432
  referenced_security_group_id = var.client_security_group_ids[count.index]
}

resource "aws_db_subnet_group" "this" {
  name        = "${var.name}-postgres"
  description = "Private subnets of the Ember registry database"
  subnet_ids  = var.subnet_ids
  tags        = var.tags
}

resource "aws_db_parameter_group" "this" {
  name        = "${var.name}-postgres${split(".", var.postgres_engine_version)[0]}"
  family      = "postgres${split(".", var.postgres_engine_version)[0]}"
  description = "Ember registry: TLS only, slow and DDL statements logged"
  tags        = var.tags

  parameter {
    name  = "rds.force_ssl"
    value = "1"
  }
  parameter {
    name  = "log_statement"
    value = "ddl"
  }
  parameter {
    name  = "log_min_duration_statement"
    value = "1000"
  }
  parameter {
    name  = "log_connections"
    value = "1"
  }
  parameter {
    name  = "log_disconnections"
    value = "1"
  }

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_iam_role" "monitoring" {
  count = var.postgres_monitoring_interval_s > 0 ? 1 : 0
  name  = "${var.name}-rds-monitoring"
  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "monitoring.rds.amazonaws.com" }
      Action    = ["sts:AssumeRole"]
    }]
  })
  tags = var.tags
}

data "aws_partition" "current" {}

resource "aws_iam_role_policy_attachment" "monitoring" {
  count      = var.postgres_monitoring_interval_s > 0 ? 1 : 0
  role       = aws_iam_role.monitoring[0].name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/service-role/AmazonRDSEnhancedMonitoringRole"
}

resource "aws_db_instance" "this" {
  identifier     = "${var.name}-registry"
  engine         = "postgres"
  engine_version = var.postgres_engine_version
  instance_class = var.postgres_instance_class

  db_name             = var.postgres_database_name
  username            = var.postgres_username
  password_wo         = local.db_password
  password_wo_version = var.credentials_version

  allocated_storage     = var.postgres_allocated_storage_gb
  max_allocated_storage = var.postgres_max_allocated_storage_gb
  storage_type          = "gp3"
  storage_encrypted     = true
  kms_key_id            = var.kms_key_arn

  multi_az               = var.postgres_multi_az
  db_subnet_group_name   = aws_db_subnet_group.this.name
  vpc_security_group_ids = [aws_security_group.postgres.id]
  publicly_accessible    = false
  parameter_group_name   = aws_db_parameter_group.this.name

  backup_retention_period   = var.postgres_backup_retention_days
  backup_window             = "03:00-04:00"
  maintenance_window        = "sun:04:30-sun:05:30"
  copy_tags_to_snapshot     = true
  deletion_protection       = var.deletion_protection
  skip_final_snapshot       = !var.deletion_protection
  final_snapshot_identifier = "${var.name}-registry-final"
  delete_automated_backups  = !var.deletion_protection

  auto_minor_version_upgrade          = true
  iam_database_authentication_enabled = true
  enabled_cloudwatch_logs_exports     = ["postgresql", "upgrade"]

  performance_insights_enabled          = true
  performance_insights_kms_key_id       = var.kms_key_arn
  performance_insights_retention_period = 7

  monitoring_interval = var.postgres_monitoring_interval_s
  monitoring_role_arn = var.postgres_monitoring_interval_s > 0 ? aws_iam_role.monitoring[0].arn : null

  tags = var.tags
}
