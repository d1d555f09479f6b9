"""`dipaco demo`'s local service: the dashboard address it prints and the token file it names (0600, readable by
a coordinator started again on the same directory)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import httpx
import pytest

from dipaco.service import LocalService

pytestmark = pytest.mark.integration


def test_the_token_file_opens_the_dashboard(tmp_path: Path) -> None:
    with LocalService(data_dir=tmp_path / "coordinator", logs=tmp_path / "logs") as service:
        assert service.dashboard_url == f"{service.url}/ui/"
        assert stat.S_IMODE(service.token_file.stat().st_mode) == 0o600
        tokens = json.loads(service.token_file.read_text())
        assert tokens == {"admin_token": service.admin_token, "join_token": service.join_token}
        page = httpx.get(service.dashboard_url, timeout=10)
        assert page.status_code == 200 and "dipaco" in page.text
        assert tokens["admin_token"] not in page.text and tokens["admin_token"] not in service.dashboard_url
        runs = httpx.get(
            f"{service.url}/v1/runs", headers={"Authorization": f"Bearer {tokens['admin_token']}"}, timeout=10
        )
        assert runs.status_code == 200 and runs.json() == {"data": [], "count": 0}
