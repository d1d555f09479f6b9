"""Create a run from a JSON spec unless a run of that name exists; print `<run id> <status>` on stdout.

The admin step of the compose stack's router job (deploy/compose.yaml) and of docs/DEPLOY.md: it waits for the
coordinator, then speaks to it through the project's one typed client (`coordinator/client.py`), so the spec is
validated against `RunCreate` before anything is sent. Running it again is harmless: an existing run of the same
name is reported, not created twice, and its status tells the caller whether shards are still to be registered.
The spec is read as `dipaco registry create-run --spec` reads it (JSON, or YAML); that command is the one to use
by hand, this script is its idempotent form for a stack that may come up many times.

    DIPACO_ADMIN_TOKEN=... python create_run.py --coordinator http://coordinator:8000 --spec run.json
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from coordinator.client import ClientError, CoordinatorClient, RetryPolicy
from coordinator.registry_cli import load_run_spec
from coordinator.schemas import RunCreate

log = logging.getLogger("create_run")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, required=True, help="run spec: the JSON (or YAML) body of POST /v1/runs")
    parser.add_argument(
        "--coordinator",
        default=os.environ.get("DIPACO_COORDINATOR", "http://127.0.0.1:8000"),
        help="coordinator base URL [env DIPACO_COORDINATOR]",
    )
    parser.add_argument(
        "--wait", type=float, default=300.0, help="seconds to keep retrying while the coordinator does not answer"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, *, http: Any = None) -> int:
    """`http`, when given, is the HTTP client to talk through (tests pass the coordinator app's TestClient)."""
    logging.basicConfig(level=logging.INFO, format="create_run: %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    token = os.environ.get("DIPACO_ADMIN_TOKEN", "")
    if not token:
        log.error("no admin token: set DIPACO_ADMIN_TOKEN")
        return 1
    try:
        spec = RunCreate.model_validate(load_run_spec(args.spec))
    except (OSError, ValueError, ValidationError) as exc:
        log.error("run spec %s: %s", args.spec, exc)
        return 1
    retry = RetryPolicy(give_up_after_s=args.wait)
    try:
        with CoordinatorClient(args.coordinator, token, http=http, retry=retry) as client:
            client.health()
            existing = [run for run in client.runs() if run.name == spec.name]
            if existing:
                run = existing[0]
                log.info("run %r exists: id %d, %s", spec.name, run.id, run.status)
            else:
                run = client.create_run(spec)
                log.info("created run %r: id %d, %d paths", spec.name, run.id, run.num_paths)
    except ClientError as exc:
        log.error("%s", exc)
        return 1
    print(run.id, run.status)  # noqa: T201 - the one line a shell script reads
    return 0


if __name__ == "__main__":
    sys.exit(main())
