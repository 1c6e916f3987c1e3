# Node groups: one CPU group for Ember's control plane processes, and one GPU group per
# accelerator type for model replicas, each with its local NVMe mounted for the cache.

resource "aws_iam_role" "node" {
  name = "${var.name}-eks-node"
  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "ec2.amazonaws.com" }
      Action    = ["sts:AssumeRole"]
    }]
  })
  tags = var.tags
}

resource "aws_iam_role_policy_attachment" "node" {
  for_each = toset([
    "AmazonEKSWorkerNodePolicy",
    "AmazonEKS_CNI_Policy",
    "AmazonEC2ContainerRegistryReadOnly",
    "AmazonSSMManagedInstanceCore",
  ])
  role       = aws_iam_role.node.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/${each.value}"
}

locals {
  # IMDSv2 only, and a hop limit of 1 so that containers cannot reach the node's
  # credentials: pods get AWS access only through IRSA (modules/iam).
  metadata_options = {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }

  nvme_script = templatefile("${path.module}/templates/nvme-cache.sh.tftpl", {
    mount_path = var.nvme_mount_path
    cache_dir  = var.cache_dir
    cache_uid  = var.cache_owner_uid
  })
  gpu_user_data = templatefile("${path.module}/templates/user-data.mime.tftpl", {
    script = local.nvme_script
  })

  gpu_labels = {
    for k, g in var.gpu_node_groups : k => {
      "ember.dev/pool"         = "gpu"
      "ember.dev/accelerator"  = g.gpu_type
      "ember.dev/gpus"         = tostring(g.gpus_per_node)
      "ember.dev/nvme-cache"   = "true"
      "nvidia.com/gpu.present" = "true"
    }
  }
}

resource "aws_launch_template" "cpu" {
  name_prefix            = "${var.name}-cpu-"
  description            = "Ember CPU nodes: encrypted root volume, IMDSv2 only"
  update_default_version = true

  metadata_options {
    http_endpoint               = local.metadata_options.http_endpoint
    http_tokens                 = local.metadata_options.http_tokens
    http_put_response_hop_limit = local.metadata_options.http_put_response_hop_limit
    instance_metadata_tags      = local.metadata_options.instance_metadata_tags
  }

  block_device_mappings {
    device_name = "/dev/xvda"
    ebs {
      volume_size           = var.cpu_node_group.disk_size_gb
      volume_type           = "gp3"
      encrypted             = true
      kms_key_id            = var.kms_key_arn
      delete_on_termination = true
    }
  }

  monitoring {
    enabled = true
  }

  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { Name = "${var.name}-cpu" })
  }

  tags = var.tags
}

resource "aws_launch_template" "gpu" {
  for_each               = var.gpu_node_groups
  name_prefix            = "${var.name}-gpu-${each.key}-"
  description            = "Ember ${each.value.gpu_type} nodes: NVMe weight cache at ${var.cache_dir}, IMDSv2 only"
  update_default_version = true
  user_data              = base64encode(local.gpu_user_data)

  metadata_options {
    http_endpoint               = local.metadata_options.http_endpoint
    http_tokens                 = local.metadata_options.http_tokens
    http_put_response_hop_limit = local.metadata_options.http_put_response_hop_limit
    instance_metadata_tags      = local.metadata_options.instance_metadata_tags
  }

  block_device_mappings {
    device_name = "/dev/xvda"
    ebs {
      volume_size           = each.value.disk_size_gb
      volume_type           = "gp3"
      encrypted             = true
      kms_key_id            = var.kms_key_arn
      delete_on_termination = true
    }
  }

  monitoring {
    enabled = true
  }

  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { Name = "${var.name}-gpu-${each.key}" })
  }

  tags = var.tags
}

resource "aws_eks_node_group" "cpu" {
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "${var.name}-cpu"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = var.subnet_ids
  ami_type        = "AL2023_x86_64_STANDARD"
  instance_types  = var.cpu_node_group.instance_types
  capacity_type   = "ON_DEMAND"

  scaling_config {
    min_size     = var.cpu_node_group.min_size
    desired_size = var.cpu_node_group.desired_size
    max_size     = var.cpu_node_group.max_size
  }

  update_config {
    max_unavailable = 1
  }

  launch_template {
    id      = aws_launch_template.cpu.id
    version = aws_launch_template.cpu.latest_version
  }

  labels = { "ember.dev/pool" = "system" }
  tags   = var.tags

  lifecycle {
    ignore_changes = [scaling_config[0].desired_size] # the cluster autoscaler owns it
  }

  depends_on = [aws_iam_role_policy_attachment.node]
}

resource "aws_eks_node_group" "gpu" {
  for_each        = var.gpu_node_groups
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "${var.name}-gpu-${each.key}"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = var.subnet_ids
  ami_type        = "AL2023_x86_64_NVIDIA"
  instance_types  = each.value.instance_types
  capacity_type   = each.value.capacity_type

  scaling_config {
    min_size     = each.value.min_size
    desired_size = each.value.desired_size
    max_size     = each.value.max_size
  }

  update_config {
    max_unavailable = 1
  }

  launch_template {
    id      = aws_launch_template.gpu[each.key].id
    version = aws_launch_template.gpu[each.key].latest_version
  }

  labels = local.gpu_labels[each.key]

  # Only pods that tolerate the GPU taint (model replicas) land on GPU nodes.
  taint {
    key    = "nvidia.com/gpu"
    value  = "true"
    effect = "NO_SCHEDULE"
  }

  tags = merge(var.tags, {
    # Lets the cluster autoscaler scale a group up from zero for a pending replica.
    "k8s.io/cluster-autoscaler/node-template/label/ember.dev/accelerator" = each.value.gpu_type
    "k8s.io/cluster-autoscaler/node-template/taint/nvidia.com/gpu"        = "true:NoSchedule"
    "k8s.io/cluster-autoscaler/node-template/resources/nvidia.com/gpu"    = tostring(each.value.gpus_per_node)
  })

  lifecycle {
    ignore_changes = [scaling_config[0].desired_size]
  }

  depends_on = [aws_iam_role_policy_attachment.node]
}
