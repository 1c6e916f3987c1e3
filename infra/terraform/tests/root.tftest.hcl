# The composed deployment: every module wired together, and Ember's settings derived
# from the outputs in the exact shape deploy/k8s consumes.

mock_provider "aws" {
  source = "./tests/mocks"
}

variables {
  name = "ember-test"
}

run "whole_stack_plans_and_applies" {
  command = apply

  assert {
    condition     = output.ember_config["EMBER_CACHE_DIR"] == "/mnt/nvme/ember-cache" && module.cluster.cache_dir == output.ember_config["EMBER_CACHE_DIR"]
    error_message = "EMBER_CACHE_DIR must be the NVMe path the GPU launch template mounts."
  }

  assert {
    condition     = output.ember_config["EMBER_OBJECT_STORE_URL"] == "s3://${output.bucket_name}/artifacts"
    error_message = "EMBER_OBJECT_STORE_URL must point at the artifacts/ prefix of the bucket."
  }

  assert {
    condition     = contains(split(",", output.ember_config["EMBER_S3_ALLOWED_BUCKETS"]), output.bucket_name)
    error_message = "The artifact bucket must be an allowed bucket."
  }

  assert {
    condition     = output.ember_config["EMBER_PORT"] == "8000" && output.ember_config["EMBER_HOST"] == "0.0.0.0"
    error_message = "The API must listen on 0.0.0.0:8000 in the pod."
  }

  assert {
    condition     = !contains(keys(output.ember_config), "EMBER_S3_ENDPOINT_URL")
    error_message = "EMBER_S3_ENDPOINT_URL must stay unset on AWS."
  }

  assert {
    condition = length(setintersection(
      toset(keys(output.ember_config)),
      toset(["EMBER_DATABASE_URL", "EMBER_REDIS_URL", "EMBER_ADMIN_KEY"]),
    )) == 0
    error_message = "Secrets must not be in the (plain) config output."
  }

  # deploy/k8s/base renders with example env files; they must have exactly the keys
  # Terraform produces, or the overlay would silently drop or miss a setting.
  assert {
    condition = toset([
      for line in split("\n", trimspace(file("../../deploy/k8s/base/ember-config.env"))) : split("=", line)[0]
    ]) == toset(keys(output.ember_config))
    error_message = "deploy/k8s/base/ember-config.env must have exactly the keys of output ember_config."
  }

  assert {
    condition = toset([
      for line in split("\n", trimspace(file("../../deploy/k8s/base/ember-infra.env"))) : split("=", line)[0]
      ]) == toset([
      for line in split("\n", trimspace(output.infra_env)) : split("=", line)[0]
    ])
    error_message = "deploy/k8s/base/ember-infra.env must have exactly the keys of output infra_env."
  }

  assert {
    condition     = module.data.app_secret_arn == output.app_secret_arn
    error_message = "The app secret must be an output."
  }

  assert {
    condition     = output.kubeconfig_command == "aws eks update-kubeconfig --region us-east-1 --name ember-test"
    error_message = "kubeconfig_command must name the region and the cluster."
  }
}

run "example_tfvars_are_valid" {
  command = plan

  variables {
    name                = "ember-prod"
    region              = "us-west-2"
    public_access_cidrs = ["203.0.113.0/24"]
    gpu_node_groups = {
      l40s = {
        instance_types = ["g6e.xlarge", "g6e.2xlarge"]
        gpu_type       = "nvidia-l40s"
        gpus_per_node  = 1
        min_size       = 0
        desired_size   = 1
        max_size       = 4
      }
      h100 = {
        instance_types = ["p5.48xlarge"]
        gpu_type       = "nvidia-h100"
        gpus_per_node  = 8
        min_size       = 0
        desired_size   = 0
        max_size       = 1
      }
    }
  }

  assert {
    condition     = output.region == "us-west-2"
    error_message = "region must pass through."
  }
}
