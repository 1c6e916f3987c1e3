# Registry for the Ember image (one image runs api, workers, beat and engines).

resource "aws_ecr_repository" "ember" {
  name                 = var.name
  image_tag_mutability = "IMMUTABLE"
  force_delete         = var.force_destroy

  image_scanning_configuration {
    scan_on_push = true
  }

  encryption_configuration {
    encryption_type = "KMS"
    kms_key         = aws_kms_key.this.arn
  }

  tags = var.tags
}

resource "aws_ecr_lifecycle_policy" "ember" {
  repository = aws_ecr_repository.ember.name
  policy = jsonencode({
    rules = [{
      rulePriority = 1
      description  = "Keep the 50 most recent images"
      selection = {
        tagStatus   = "any"
        countType   = "imageCountMoreThan"
        countNumber = 50
      }
      action = { type = "expire" }
    }]
  })
}
