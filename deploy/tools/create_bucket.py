"""Create the S3 bucket named by DIPACO_BLOB_URL (`s3://bucket/prefix`) unless it exists.

A one-shot step of the compose stack and the Kubernetes `dev` overlay, where MinIO starts empty. It reads the
coordinator's own settings: DIPACO_BLOB_URL, DIPACO_S3_ENDPOINT_URL and the usual AWS_* credentials. A managed
bucket (the `prod` overlay) is created by whoever owns the account, not by this.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

import boto3  # the image installs the s3 extra
from botocore.exceptions import BotoCoreError, ClientError

log = logging.getLogger("create_bucket")


def bucket_of(blob_url: str) -> str:
    if not blob_url.startswith("s3://") or not blob_url[len("s3://") :].partition("/")[0]:
        raise ValueError(f"DIPACO_BLOB_URL must be s3://bucket[/prefix], got {blob_url!r}")
    return blob_url[len("s3://") :].partition("/")[0]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="create_bucket: %(message)s", stream=sys.stderr)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to keep retrying while the store is down")
    args = parser.parse_args(argv)
    try:
        bucket = bucket_of(os.environ.get("DIPACO_BLOB_URL", ""))
    except ValueError as exc:
        log.error("%s", exc)
        return 1
    endpoint = os.environ.get("DIPACO_S3_ENDPOINT_URL") or None
    where = endpoint or "AWS"
    client = boto3.client("s3", endpoint_url=endpoint)
    deadline = time.monotonic() + args.wait
    delay = 0.5
    while True:
        try:
            if _exists(client, bucket):
                log.info("bucket %s exists at %s", bucket, where)
            else:
                region = client.meta.region_name
                extra = (
                    {}
                    if region in (None, "us-east-1")
                    else {"CreateBucketConfiguration": {"LocationConstraint": region}}
                )
                client.create_bucket(Bucket=bucket, **extra)
                log.info("created bucket %s at %s", bucket, where)
            return 0
        except ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) < 500:
                log.error("bucket %s at %s: %s", bucket, where, exc)
                return 1
            problem: Exception = exc  # 5xx: a store that is still starting
        except BotoCoreError as exc:  # not reachable yet
            problem = exc
        if time.monotonic() + delay > deadline:
            log.error("gave up on the store at %s after %.0f s: %s", where, args.wait, problem)
            return 1
        log.info("store at %s not ready (%s); retrying in %.1f s", where, problem, delay)
        time.sleep(delay)
        delay = min(2 * delay, 10.0)


def _exists(client: Any, bucket: str) -> bool:
    """True when the bucket exists and is ours, False on 404; other errors propagate."""
    try:
        client.head_bucket(Bucket=bucket)
        return True
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchBucket"):
            return False
        raise


if __name__ == "__main__":
    sys.exit(main())
