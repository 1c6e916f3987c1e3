terraform {
  # 1.11: write-only arguments keep the database password and Ember's admin key out of
  # the state (modules/data).
  required_version = ">= 1.11.0"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.95.0, < 6.0.0"
    }
  }

  # Keep the state remote, encrypted and locked: it holds the Redis AUTH token.
  # Copy backend.tf.example to backend.tf and fill it in (README, step 2).
}

provider "aws" {
  region = var.region

  default_tags {
    tags = merge(var.tags, {
      "app.kubernetes.io/part-of" = "ember"
      "ember.dev/deployment"      = var.name
    })
  }
}
