# Plausible values for computed attributes that the AWS provider validates as ARNs or
# that the modules index into; everything else keeps the mock's random strings.

mock_data "aws_caller_identity" {
  defaults = { account_id = "123456789012" }
}

mock_data "aws_partition" {
  defaults = { partition = "aws" }
}

mock_data "aws_region" {
  defaults = { name = "us-east-1" }
}

mock_data "aws_availability_zones" {
  defaults = { names = ["us-east-1a", "us-east-1b", "us-east-1c", "us-east-1d"] }
}

mock_resource "aws_kms_key" {
  defaults = { arn = "arn:aws:kms:us-east-1:123456789012:key/11111111-2222-3333-4444-555555555555" }
}

mock_resource "aws_s3_bucket" {
  defaults = { arn = "arn:aws:s3:::ember-test-artifacts-123456789012" }
}

mock_resource "aws_iam_role" {
  defaults = { arn = "arn:aws:iam::123456789012:role/ember-test-mock" }
}

mock_resource "aws_cloudwatch_log_group" {
  defaults = { arn = "arn:aws:logs:us-east-1:123456789012:log-group:/ember/mock" }
}

mock_resource "aws_secretsmanager_secret" {
  defaults = { arn = "arn:aws:secretsmanager:us-east-1:123456789012:secret:ember-test/ember-app-AbCdEf" }
}

mock_resource "aws_iam_openid_connect_provider" {
  defaults = { arn = "arn:aws:iam::123456789012:oidc-provider/oidc.eks.us-east-1.amazonaws.com/id/MOCK" }
}

mock_resource "aws_db_instance" {
  defaults = {
    address = "ember-test-registry.abc123.us-east-1.rds.amazonaws.com"
    port    = 5432
  }
}

mock_resource "aws_elasticache_replication_group" {
  defaults = { primary_endpoint_address = "master.ember-test-redis.abc123.use1.cache.amazonaws.com" }
}

mock_resource "aws_eks_cluster" {
  defaults = {
    arn                   = "arn:aws:eks:us-east-1:123456789012:cluster/ember-test"
    endpoint              = "https://MOCK.gr7.us-east-1.eks.amazonaws.com"
    certificate_authority = [{ data = "TU9DSw==" }]
    identity              = [{ oidc = [{ issuer = "https://oidc.eks.us-east-1.amazonaws.com/id/MOCK" }] }]
  }
}

mock_resource "aws_launch_template" {
  defaults = {
    id             = "lt-0123456789abcdef0"
    latest_version = 1
  }
}
