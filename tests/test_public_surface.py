"""Pins the public surface: CLI commands and HTTP routes are contracts (ARCHITECTURE §5, §6)."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from typer.main import get_command

from coordinator.app import create_app
from coordinator.settings import Settings
from dipaco.cli import app


def test_cli_commands() -> None:
    root = get_command(app)
    groups = {name: sorted(getattr(cmd, "commands", {})) for name, cmd in root.commands.items()}  # type: ignore[attr-defined]
    assert groups == {
        "coordinator": ["apply-worker", "migrate", "serve", "tokens"],
        "demo": [],
        "eval": [],
        "export": [],
        "generate": [],
        "island": ["join"],
        "registry": ["contributions", "create-run", "islands", "modules", "paths", "runs"],
        "router": ["corpus", "refit", "register", "shard"],
    }


def test_http_routes(tmp_path: Path) -> None:
    spec = create_app(Settings(data_dir=tmp_path)).openapi()
    routes = sorted((method.upper(), path) for path, ops in spec["paths"].items() for method in ops)
    assert routes == [
        ("DELETE", "/v1/islands/{island_id}"),
        ("GET", "/healthz"),
        ("GET", "/metrics"),
        ("GET", "/v1/contributions"),
        ("GET", "/v1/events"),
        ("GET", "/v1/islands"),
        ("GET", "/v1/leases"),
        ("GET", "/v1/leases/{lease_id}/modules"),
        ("GET", "/v1/modules"),
        ("GET", "/v1/modules/{module_id}"),
        ("GET", "/v1/modules/{module_id}/weights"),
        ("GET", "/v1/paths"),
        ("GET", "/v1/paths/{path_id}"),
        ("GET", "/v1/run-stats"),
        ("GET", "/v1/runs"),
        ("GET", "/v1/runs/{run_id}"),
        ("GET", "/v1/runs/{run_id}/history"),
        ("GET", "/v1/runs/{run_id}/rounds"),
        ("GET", "/v1/shards/{shard_id}/heldout"),
        ("GET", "/v1/shards/{shard_id}/tokens"),
        ("POST", "/v1/islands"),
        ("POST", "/v1/islands/{island_id}/heartbeat"),
        ("POST", "/v1/islands/{island_id}/lease"),
        ("POST", "/v1/leases/{lease_id}/commit"),
        ("POST", "/v1/leases/{lease_id}/outer-gradients"),
        ("POST", "/v1/leases/{lease_id}/release"),
        ("POST", "/v1/leases/{lease_id}/upload-url"),
        ("POST", "/v1/runs"),
        ("POST", "/v1/runs/{run_id}/shards/{path_index}"),
        ("POST", "/v1/runs/{run_id}/shards/{path_index}/heldout"),
    ]


def test_dashboard_is_served_at_ui(tmp_path: Path) -> None:
    """The web dashboard is a contract too (ARCHITECTURE §5), served outside the API schema (HTML, not JSON)."""
    client = TestClient(create_app(Settings(data_dir=tmp_path)))  # no lifespan needed: static files only
    assert client.get("/ui/").status_code == 200
    assert client.get("/ui", follow_redirects=False).headers["location"] == "ui/"
