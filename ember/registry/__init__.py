"""The model registry: tenants, API keys, models, versions, deployments (SQLModel + Alembic)."""
