# Network: private subnets across >= 2 AZs, or an existing VPC passed through untouched.

mock_provider "aws" {
  source = "./tests/mocks"
}

variables {
  name        = "ember-test"
  kms_key_arn = "arn:aws:kms:us-east-1:123456789012:key/11111111-2222-3333-4444-555555555555"
}

run "new_vpc_spans_three_azs" {
  command = apply

  module {
    source = "./modules/network"
  }

  assert {
    condition     = length(aws_subnet.private) == 3 && length(distinct(aws_subnet.private[*].availability_zone)) == 3
    error_message = "Private subnets must be one per AZ, in three distinct AZs by default."
  }

  assert {
    condition     = alltrue([for s in concat(aws_subnet.private, aws_subnet.public) : !s.map_public_ip_on_launch])
    error_message = "No subnet may hand out public IPs."
  }

  assert {
    condition     = length(aws_nat_gateway.this) == 1 && alltrue([for r in aws_route.private_nat : r.nat_gateway_id == aws_nat_gateway.this[0].id])
    error_message = "With single_nat_gateway every private route table must use the one NAT gateway."
  }

  assert {
    condition     = aws_flow_log.this[0].traffic_type == "ALL" && aws_cloudwatch_log_group.flow[0].kms_key_id == var.kms_key_arn
    error_message = "VPC flow logs must record all traffic into a KMS-encrypted log group."
  }

  assert {
    condition     = length(aws_default_security_group.this[0].ingress) == 0 && length(aws_default_security_group.this[0].egress) == 0
    error_message = "The default security group must allow nothing."
  }

  assert {
    condition     = aws_vpc_endpoint.s3[0].vpc_endpoint_type == "Gateway" && toset(aws_vpc_endpoint.s3[0].route_table_ids) == toset(aws_route_table.private[*].id)
    error_message = "Private subnets must reach S3 through the gateway endpoint."
  }
}

run "nat_per_az_when_asked" {
  command = apply

  module {
    source = "./modules/network"
  }

  variables {
    az_count           = 2
    single_nat_gateway = false
  }

  assert {
    condition     = length(aws_nat_gateway.this) == 2 && length(aws_subnet.private) == 2
    error_message = "single_nat_gateway = false must create one NAT gateway per AZ."
  }
}

run "existing_vpc_is_passed_through" {
  command = apply

  module {
    source = "./modules/network"
  }

  variables {
    existing_vpc = {
      vpc_id             = "vpc-0123456789abcdef0"
      private_subnet_ids = ["subnet-aaaa", "subnet-bbbb"]
    }
  }

  assert {
    condition     = length(aws_vpc.this) == 0 && length(aws_subnet.private) == 0 && length(aws_nat_gateway.this) == 0
    error_message = "An existing VPC must not create network resources."
  }

  assert {
    condition     = output.vpc_id == "vpc-0123456789abcdef0" && output.private_subnet_ids == tolist(["subnet-aaaa", "subnet-bbbb"])
    error_message = "The existing VPC's ids must pass through."
  }
}

run "one_az_is_refused" {
  command = plan

  module {
    source = "./modules/network"
  }

  variables {
    az_count = 1
  }

  expect_failures = [var.az_count]
}

run "existing_vpc_needs_two_subnets" {
  command = plan

  module {
    source = "./modules/network"
  }

  variables {
    existing_vpc = {
      vpc_id             = "vpc-0123456789abcdef0"
      private_subnet_ids = ["subnet-aaaa"]
    }
  }

  expect_failures = [var.existing_vpc]
}
