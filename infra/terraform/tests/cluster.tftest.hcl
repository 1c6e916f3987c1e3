# EKS: private API by default, encrypted secrets, IMDSv2 with hop limit 1 on every node,
# GPU nodes with local NVMe formatted and mounted for the weight cache, labelled and
# tainted by GPU type.

mock_provider "aws" {
  source = "./tests/mocks"
}

variables {
  name        = "ember-test"
  vpc_id      = "vpc-0123456789abcdef0"
  subnet_ids  = ["subnet-aaaa", "subnet-bbbb"]
  kms_key_arn = "arn:aws:kms:us-east-1:123456789012:key/11111111-2222-3333-4444-555555555555"
  gpu_node_groups = {
    l40s = {
      instance_types = ["g6e.xlarge"]
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
      max_size       = 2
      capacity_type  = "SPOT"
    }
  }
}

run "every_node_requires_imdsv2" {
  command = apply

  module {
    source = "./modules/cluster"
  }

  assert {
    condition = alltrue([
      for lt in concat([aws_launch_template.cpu], values(aws_launch_template.gpu)) :
      lt.metadata_options[0].http_tokens == "required" && lt.metadata_options[0].http_put_response_hop_limit == 1
    ])
    error_message = "Every launch template must require IMDSv2 tokens with a hop limit of 1 (pods cannot reach node credentials)."
  }

  assert {
    condition = alltrue([
      for lt in concat([aws_launch_template.cpu], values(aws_launch_template.gpu)) :
      alltrue([for b in lt.block_device_mappings : b.ebs[0].encrypted == "true" && b.ebs[0].kms_key_id == var.kms_key_arn])
    ])
    error_message = "Node volumes must be encrypted with the deployment key."
  }

  assert {
    condition = alltrue([
      for ng in concat([aws_eks_node_group.cpu], values(aws_eks_node_group.gpu)) : ng.launch_template[0].id != null && length(ng.remote_access) == 0
    ])
    error_message = "Every node group must use its launch template and allow no SSH."
  }
}

run "gpu_nodes_mount_nvme_for_the_cache" {
  command = apply

  module {
    source = "./modules/cluster"
  }

  assert {
    condition = alltrue([
      for lt in values(aws_launch_template.gpu) : strcontains(base64decode(lt.user_data), "Content-Type: text/x-shellscript")
    ])
    error_message = "GPU user data must be a MIME multi-part document with a shell script part (EKS managed node groups merge it)."
  }

  assert {
    condition = alltrue([
      for needle in [
        "Amazon EC2 NVMe Instance Storage",
        "mdadm --create",
        "mkfs.xfs",
        "mount -o noatime,nodiratime",
        "MOUNT_PATH=\"/mnt/nvme\"",
        "CACHE_DIR=\"/mnt/nvme/ember-cache\"",
        "CACHE_UID=\"10001\"",
        "/etc/fstab",
      ] : strcontains(base64decode(aws_launch_template.gpu["l40s"].user_data), needle)
    ])
    error_message = "GPU user data must RAID-0, format (XFS) and mount the instance-store NVMe at /mnt/nvme and own the cache directory."
  }

  assert {
    condition     = output.cache_dir == "/mnt/nvme/ember-cache"
    error_message = "The weight cache must live on the NVMe mount."
  }

  assert {
    condition     = length(aws_launch_template.cpu.user_data == null ? "" : aws_launch_template.cpu.user_data) == 0
    error_message = "CPU nodes have no NVMe script."
  }
}

run "gpu_nodes_are_labelled_and_tainted_by_type" {
  command = apply

  module {
    source = "./modules/cluster"
  }

  assert {
    condition = (
      aws_eks_node_group.gpu["l40s"].labels["ember.dev/accelerator"] == "nvidia-l40s"
      && aws_eks_node_group.gpu["h100"].labels["ember.dev/accelerator"] == "nvidia-h100"
      && aws_eks_node_group.gpu["h100"].labels["ember.dev/gpus"] == "8"
      && aws_eks_node_group.gpu["h100"].labels["ember.dev/nvme-cache"] == "true"
    )
    error_message = "GPU nodes must carry ember.dev/accelerator, ember.dev/gpus and ember.dev/nvme-cache labels."
  }

  assert {
    condition = alltrue([
      for ng in values(aws_eks_node_group.gpu) : anytrue([
        for t in ng.taint : t.key == "nvidia.com/gpu" && t.effect == "NO_SCHEDULE"
      ])
    ])
    error_message = "GPU nodes must be tainted so only replicas land there."
  }

  assert {
    condition     = alltrue([for ng in values(aws_eks_node_group.gpu) : ng.ami_type == "AL2023_x86_64_NVIDIA"])
    error_message = "GPU nodes must boot the NVIDIA AMI."
  }

  assert {
    condition     = aws_eks_node_group.gpu["h100"].capacity_type == "SPOT" && aws_eks_node_group.gpu["l40s"].capacity_type == "ON_DEMAND"
    error_message = "capacity_type must pass through per group."
  }

  assert {
    condition     = aws_eks_node_group.gpu["h100"].tags["k8s.io/cluster-autoscaler/node-template/resources/nvidia.com/gpu"] == "8"
    error_message = "GPU groups must advertise their GPUs to the cluster autoscaler for scale-from-zero."
  }
}

run "control_plane_is_private_and_encrypted" {
  command = apply

  module {
    source = "./modules/cluster"
  }

  assert {
    condition     = !aws_eks_cluster.this.vpc_config[0].endpoint_public_access && aws_eks_cluster.this.vpc_config[0].endpoint_private_access
    error_message = "The Kubernetes API must be private by default."
  }

  assert {
    condition = (
      aws_eks_cluster.this.encryption_config[0].provider[0].key_arn == var.kms_key_arn
      && contains(aws_eks_cluster.this.encryption_config[0].resources, "secrets")
    )
    error_message = "Kubernetes secrets must be envelope-encrypted with the deployment key."
  }

  assert {
    condition     = toset(aws_eks_cluster.this.enabled_cluster_log_types) == toset(["api", "audit", "authenticator", "controllerManager", "scheduler"])
    error_message = "Every control plane log type must be enabled."
  }

  assert {
    condition     = aws_iam_openid_connect_provider.this.url == "https://oidc.eks.us-east-1.amazonaws.com/id/MOCK" && contains(aws_iam_openid_connect_provider.this.client_id_list, "sts.amazonaws.com")
    error_message = "The OIDC provider must trust the cluster issuer for IRSA."
  }
}

run "public_endpoint_only_for_listed_cidrs" {
  command = apply

  module {
    source = "./modules/cluster"
  }

  variables {
    public_access_cidrs = ["203.0.113.0/24"]
  }

  assert {
    condition     = aws_eks_cluster.this.vpc_config[0].endpoint_public_access && tolist(aws_eks_cluster.this.vpc_config[0].public_access_cidrs) == tolist(["203.0.113.0/24"])
    error_message = "A public endpoint must be limited to public_access_cidrs."
  }
}

run "world_open_endpoint_is_refused" {
  command = plan

  module {
    source = "./modules/cluster"
  }

  variables {
    public_access_cidrs = ["0.0.0.0/0"]
  }

  expect_failures = [var.public_access_cidrs]
}

run "gpu_types_without_nvme_are_refused" {
  command = plan

  module {
    source = "./modules/cluster"
  }

  variables {
    gpu_node_groups = {
      bad = {
        instance_types = ["g5g.xlarge", "m7i.large"]
        gpu_type       = "none"
        gpus_per_node  = 1
        min_size       = 0
        desired_size   = 0
        max_size       = 1
      }
    }
  }

  expect_failures = [var.gpu_node_groups]
}
