"""Check what `terraform apply` really created in moto.

usage: python verify.py ENDPOINT   (outputs read from `terraform output -json` on stdin)
Exits 1 listing every failed check. Run by infra/check.sh between apply and destroy.
"""

from __future__ import annotations

import base64
import fnmatch
import json
import sys
from collections.abc import Callable
from typing import Any

import boto3

failures: list[str] = []


def check(what: str, ok: bool) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {what}")
    if not ok:
        failures.append(what)


def client(endpoint: str, service: str, **creds: Any) -> Any:
    creds = creds or {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    return boto3.client(service, endpoint_url=endpoint, region_name="us-east-1", **creds)


def verify_bucket(c: Callable[[str], Any], out: dict[str, Any]) -> None:
    s3, bucket = c("s3"), out["bucket_name"]
    rule = s3.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]["Rules"][0]
    default = rule["ApplyServerSideEncryptionByDefault"]
    check("bucket: SSE-KMS with the deployment key",
          default["SSEAlgorithm"] == "aws:kms" and default["KMSMasterKeyID"] == out["kms_key_arn"])
    pab = s3.get_public_access_block(Bucket=bucket)["PublicAccessBlockConfiguration"]
    check("bucket: all public access blocked", all(pab.values()) and len(pab) == 4)
    check("bucket: versioning enabled", s3.get_bucket_versioning(Bucket=bucket).get("Status") == "Enabled")
    policy = json.loads(s3.get_bucket_policy(Bucket=bucket)["Policy"])
    check("bucket: policy denies non-TLS requests", any(
        s["Effect"] == "Deny" and s.get("Condition", {}).get("Bool", {}).get("aws:SecureTransport") == "false"
        for s in policy["Statement"]))
    rules = s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]
    expiring = {r.get("Filter", {}).get("Prefix") for r in rules if "Expiration" in r}
    check("bucket: prediction-logs/ and batch-outputs/ expire",
          {"prediction-logs/", "batch-outputs/"} <= expiring and "artifacts/" not in expiring)
    logging = s3.get_bucket_logging(Bucket=bucket).get("LoggingEnabled", {})
    check("bucket: server access logging on", logging.get("TargetBucket") == f"{bucket}-access-logs")
    key_id = out["kms_key_arn"].rsplit("/", 1)[-1]
    check("kms: key rotation enabled", c("kms").get_key_rotation_status(KeyId=key_id)["KeyRotationEnabled"])
    repo = c("ecr").describe_repositories()["repositories"][0]
    check("ecr: immutable tags, scan on push", repo["imageTagMutability"] == "IMMUTABLE"
          and repo["imageScanningConfiguration"]["scanOnPush"])


def verify_data(c: Callable[[str], Any], out: dict[str, Any]) -> None:
    db = c("rds").describe_db_instances(DBInstanceIdentifier=out["postgres_instance_id"])["DBInstances"][0]
    check("rds: storage encrypted with the deployment key",
          db["StorageEncrypted"] and db["KmsKeyId"] == out["kms_key_arn"])
    check("rds: not publicly accessible", not db["PubliclyAccessible"])
    check("rds: automated backups kept", db["BackupRetentionPeriod"] >= 1)
    group = db["DBParameterGroups"][0]["DBParameterGroupName"]
    params = c("rds").describe_db_parameters(DBParameterGroupName=group)["Parameters"]
    check("rds: rds.force_ssl = 1",
          any(p["ParameterName"] == "rds.force_ssl" and p.get("ParameterValue") == "1" for p in params))
    secret = c("secretsmanager").get_secret_value(SecretId=out["app_secret_arn"])
    env = json.loads(secret["SecretString"])
    check("secret: holds exactly the three credentials",
          set(env) == {"EMBER_DATABASE_URL", "EMBER_REDIS_URL", "EMBER_ADMIN_KEY"})
    url = env.get("EMBER_DATABASE_URL", "")
    check("secret: EMBER_DATABASE_URL is postgresql+psycopg to the RDS endpoint over TLS",
          url.startswith("postgresql+psycopg://ember:") and f"@{db['Endpoint']['Address']}:" in url
          and url.endswith("/ember?sslmode=require"))
    password = url.split("://ember:", 1)[-1].split("@", 1)[0]
    check("secret: generated password is 64 URL-safe characters",
          len(password) == 64 and password.isalnum())
    check("secret: EMBER_ADMIN_KEY is generated, 64 characters, not the password",
          len(env.get("EMBER_ADMIN_KEY", "")) == 64 and env["EMBER_ADMIN_KEY"] != password)
    check("secret: EMBER_REDIS_URL uses TLS (rediss://) with AUTH",
          env.get("EMBER_REDIS_URL", "").startswith("rediss://:"))
    meta = c("secretsmanager").describe_secret(SecretId=out["app_secret_arn"])
    check("secret: encrypted with the deployment key", meta.get("KmsKeyId") == out["kms_key_arn"])


def verify_cluster(c: Callable[[str], Any], out: dict[str, Any]) -> None:
    if not out.get("cluster_name"):
        return
    eks = c("eks")
    cluster = eks.describe_cluster(name=out["cluster_name"])["cluster"]
    check("eks: secrets encrypted with the deployment key",
          cluster["encryptionConfig"][0]["provider"]["keyArn"] == out["kms_key_arn"])
    check("eks: private API endpoint only", not cluster["resourcesVpcConfig"]["endpointPublicAccess"])
    groups = eks.list_nodegroups(clusterName=out["cluster_name"])["nodegroups"]
    gpu = [eks.describe_nodegroup(clusterName=out["cluster_name"], nodegroupName=g)["nodegroup"]
           for g in groups if "-gpu-" in g]
    check("eks: GPU node group labelled by accelerator and tainted",
          bool(gpu) and all(g["labels"].get("ember.dev/accelerator") and
                            any(t["key"] == "nvidia.com/gpu" for t in g.get("taints", [])) for g in gpu))
    ec2 = c("ec2")
    for lt in ec2.describe_launch_templates()["LaunchTemplates"]:
        data = ec2.describe_launch_template_versions(LaunchTemplateId=lt["LaunchTemplateId"])[
            "LaunchTemplateVersions"][0]["LaunchTemplateData"]
        meta = data.get("MetadataOptions", {})
        check(f"ec2: {lt['LaunchTemplateName']} requires IMDSv2, hop limit 1",
              meta.get("HttpTokens") == "required" and meta.get("HttpPutResponseHopLimit") == 1)
        if "-gpu-" in lt["LaunchTemplateName"]:
            script = base64.b64decode(data.get("UserData", "")).decode()
            check(f"ec2: {lt['LaunchTemplateName']} formats and mounts the NVMe cache",
                  "mkfs.xfs" in script and 'CACHE_DIR="/mnt/nvme/ember-cache"' in script)


def allows(policy: dict[str, Any], action: str, resource: str) -> bool:
    """IAM evaluation for one request without conditions: an explicit Deny wins, then
    any Allow whose Action and Resource patterns (``*`` / ``?`` globs) match."""
    def matches(patterns: str | list[str], value: str) -> bool:
        items = [patterns] if isinstance(patterns, str) else patterns
        return any(fnmatch.fnmatchcase(value, p) for p in items)

    hits = [s for s in policy["Statement"]
            if matches(s["Action"], action) and matches(s["Resource"], resource)]
    return not any(s["Effect"] == "Deny" for s in hits) and any(s["Effect"] == "Allow" for s in hits)


def verify_iam(c: Callable[[str], Any], out: dict[str, Any]) -> None:
    """Evaluate the policies IAM actually stored against the requests each process makes.

    moto's own IAM enforcement authorises S3 object calls against the bucket ARN only
    (never bucket/key), so it cannot judge prefix-scoped grants; the documents it stored
    are evaluated here instead.
    """
    iam, bucket = c("iam"), f"arn:aws:s3:::{out['bucket_name']}"
    policies = {}
    for kind, arn in out["role_arns"].items():
        role = arn.rsplit("/", 1)[-1]
        names = iam.list_role_policies(RoleName=role)["PolicyNames"]
        attached = iam.list_attached_role_policies(RoleName=role)["AttachedPolicies"]
        check(f"iam: {kind} has exactly one inline policy and no managed ones",
              len(names) == 1 and not attached)
        doc = iam.get_role_policy(RoleName=role, PolicyName=names[0])["PolicyDocument"]
        policies[kind] = json.loads(doc) if isinstance(doc, str) else doc
        trust = iam.get_role(RoleName=role)["Role"]["AssumeRolePolicyDocument"]
        trust = json.loads(trust) if isinstance(trust, str) else trust
        subs = [v for s in trust["Statement"] for k, v in s["Condition"]["StringEquals"].items()
                if k.endswith(":sub")]
        check(f"iam: {kind} is assumable only by its service account",
              len(subs) == 1 and subs[0].startswith("system:serviceaccount:ember:ember-"))

    expected = [
        ("api", "s3:PutObject", "artifacts/m/1/model.safetensors", True),
        ("api", "s3:PutObject", "prediction-logs/2026/01/01.jsonl", True),
        ("api", "s3:PutObject", "batch-outputs/run-1/shard-0", False),
        ("api", "s3:PutObject", "elsewhere/x", False),
        ("api", "s3:DeleteObject", "artifacts/m/1/model.safetensors", False),
        ("worker", "s3:PutObject", "batch-outputs/run-1/shard-0", True),
        ("worker", "s3:PutObject", "job-results/j-1", True),
        ("worker", "s3:PutObject", "artifacts/m/1/model.safetensors", False),
        ("replica", "s3:GetObject", "artifacts/m/1/model.safetensors", True),
        ("replica", "s3:PutObject", "artifacts/m/1/model.safetensors", False),
        ("replica", "s3:GetObject", "batch-outputs/run-1/shard-0", False),
        ("replica", "s3:PutBucketPolicy", "", False),
    ]
    for kind, action, key, want in expected:
        resource = f"{bucket}/{key}" if key else bucket
        check(f"iam: {kind} {action} {key or '(bucket)'} -> {'allowed' if want else 'denied'}",
              allows(policies[kind], action, resource) == want)


def main() -> int:
    endpoint = sys.argv[1]
    out = {k: v["value"] for k, v in json.load(sys.stdin).items()}

    def c(service: str) -> Any:
        return client(endpoint, service)

    verify_bucket(c, out)
    verify_data(c, out)
    verify_cluster(c, out)
    verify_iam(c, out)
    print(f"verify: {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
