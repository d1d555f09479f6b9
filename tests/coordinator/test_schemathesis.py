"""Schemathesis against the live coordinator (uvicorn on loopback): for every operation of the OpenAPI document,
generated requests (valid and not) never get a server error, and every answer is one the document lists, with
the body it describes. Bounded: a fixed number of examples per operation, derandomised, a small model budget so
that generated run specs stay cheap to create."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from coordinator.app import create_app
from coordinator.settings import Settings
from tests.conftest import ADMIN, JOIN, FakeClock
from tests.coordinator.helpers import A, create_running_run, served

EXAMPLES = 12
"""Generated requests per operation (x ~25 operations)."""


@pytest.fixture(scope="module")
def live_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    data = tmp_path_factory.mktemp("schemathesis")
    live = Settings(
        data_dir=data,
        database_url=f"sqlite:///{Path(data) / 'registry.db'}",
        admin_token=ADMIN,
        join_token=JOIN,  # type: ignore[arg-type]
        max_path_params=200_000,
        max_json_bytes=64 << 10,
    )
    with served(live, FakeClock()) as url:
        with httpx.Client(base_url=url) as http:  # something to find: a running run, modules, paths, shards
            create_running_run(http)  # type: ignore[arg-type]
        yield url


def _document() -> dict[str, object]:
    """The OpenAPI document the app serves (built without starting it: no database, no lifespan)."""
    return create_app(Settings(data_dir=Path("unused"), migrate_on_start=False)).openapi()


# pytest's lazy `from_fixture` loader does not run under this pytest; the document does not depend on the
# database, so it is loaded at collection and the live server comes from the module fixture
schema = schemathesis.openapi.from_dict(_document())


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_no_server_errors_and_answers_as_documented(case: schemathesis.Case, live_url: str) -> None:
    case.call_and_validate(
        base_url=live_url,
        headers=A,
        checks=[not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance],
    )
