# Generated credentials. Terraform's uuid() draws 122 bits from the OS CSPRNG (crypto/rand)
# per call; two calls, dashes dropped, give a 64-character hex secret of 244 random bits
# that is URL-safe (it is embedded in EMBER_DATABASE_URL / EMBER_REDIS_URL) and needs no
# provider. A local is evaluated once per run, so the RDS password_wo and the app secret
# written in the same apply get the same value; on later runs the new value is simply
# not sent, because write-only arguments are only sent when credentials_version changes.
# (Secrets Manager's ephemeral random-password resource would do the same, but Terraform
# 1.11 cannot mock ephemeral resources, which would leave this module untestable offline.)

locals {
  generated = {
    for name in ["db_password", "admin_key", "redis_auth_token"] :
    name => join("", [for _ in range(2) : replace(uuid(), "-", "")])
  }

  db_password = local.generated.db_password
  admin_key   = local.generated.admin_key
}
