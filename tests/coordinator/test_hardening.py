"""Requests an attacker or a careless user sends: each gets a specific 4xx, costs little, and changes nothing."""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import SecretStr

from coordinator.api.spool import process_spool
from coordinator.app import create_app
from coordinator.auth import TokenFileError, load_service_tokens
from coordinator.settings import Settings, redact_url
from modules import encode
from tests.conftest import ADMIN, FakeClock
from tests.coordinator.helpers import A, J, create_running_run, join, lease, served, train_lease, upload

BIG = 2**63
"""One past what the database stores: used to give 500 (SQLite OverflowError) wherever an integer went."""


def _raw_request(url: str, head: bytes, body_prefix: bytes, *, timeout_s: float = 5.0) -> tuple[int, bytes, float]:
    """Send `head` and only the start of a body, then read the reply: (status, reply, seconds to the reply)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
        started = time.monotonic()
        s.sendall(head + body_prefix)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.split(b"\r\n\r\n", 1)[1]:
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
        elapsed = time.monotonic() - started
    return int(reply.split(b" ", 2)[1]), reply, elapsed


def test_a_huge_body_without_a_good_token_is_answered_before_it_is_read(settings: Settings, clock: FakeClock) -> None:
    """400 MiB announced, 1 KiB sent: the 401 comes back at once (the server never waits for the rest)."""
    with served(settings, clock) as url:
        for path, token in (("/v1/islands", None), ("/v1/runs", "Bearer wrong-token")):
            auth = f"Authorization: {token}\r\n" if token else ""
            head = (
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
                f"Content-Length: {400 << 20}\r\n\r\n"
            ).encode()
            status, reply, elapsed = _raw_request(url, head, b"{" + b" " * 1023)
            assert status == 401 and elapsed < 2.0, (path, reply[:200])
            assert b"bearer token" in reply or b"unknown token" in reply


def test_json_bodies_are_capped(settings: Settings, clock: FakeClock) -> None:
    settings.max_json_bytes = 4096
    with served(settings, clock) as url:
        head = (
            f"POST /v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {1 << 20}\r\n\r\n"
        ).encode()
        status, reply, _ = _raw_request(url, head, b"{")
        assert status == 413 and b"body of 1048576 bytes is over the 4096-byte limit" in reply
    with TestClient(create_app(settings, clock=clock)) as client:
        big = {"name": "x" * 5000}  # declared length over the cap
        r = client.post("/v1/runs", json=big, headers=A)
        assert r.status_code == 413
        chunked = client.post("/v1/runs", content=iter([b'{"name": "', b"y" * 5000, b'"}']), headers=A)
        assert chunked.status_code == 413, chunked.text  # no length declared: cut off while it streams
        assert "over the 4096-byte limit" in chunked.json()["detail"]
        assert client.get("/v1/runs", headers=A).json()["count"] == 0


def test_integers_past_the_database_are_refused_with_422(client: TestClient) -> None:
    run = create_running_run(client)
    for url in (
        f"/v1/runs/{BIG}",
        f"/v1/runs/{BIG}/rounds",
        f"/v1/modules/{BIG}",
        f"/v1/modules/1/weights?version={BIG}",
        f"/v1/modules?run_id={BIG}",
        f"/v1/paths?offset={BIG}",
        f"/v1/contributions?round={BIG}",
        f"/v1/shards/{BIG}/tokens",
        f"/v1/islands?offset={BIG}",
    ):
        r = client.get(url, headers=A)
        assert r.status_code == 422, (url, r.status_code, r.text)
    island_id, h = join(client)
    assert client.post(f"/v1/islands/{BIG}/heartbeat", headers=h).status_code == 422
    body = lease(client, island_id, h)
    assert body is not None
    r = upload(client, body, h, train_lease(client, body, h), tokens=BIG)
    assert r.status_code == 422 and r.json()["detail"].startswith("header X-Dipaco-Tokens must be in [0, ")
    r = client.post(f"/v1/runs/{run['id']}/shards/0?num_documents={BIG}", content=b"\x01\x00" * 100, headers=A)
    assert r.status_code == 422


def _payload_with_header(header: dict[str, Any]) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


def test_malformed_safetensors_headers_are_422_never_500(client: TestClient) -> None:
    create_running_run(client)
    island_id, h = join(client)
    body = lease(client, island_id, h)
    assert body is not None
    name = f"{body['modules'][0]['level_name']}/tok_emb.weight"
    good = train_lease(client, body, h)
    name = next(iter(good))
    shape = list(good[name].shape)
    cases = {
        "string offsets": {name: {"dtype": "F32", "shape": shape, "data_offsets": ["0", "4"]}},
        "nested offsets": {name: {"dtype": "F32", "shape": shape, "data_offsets": [[0], [4]]}},
        "boolean shape": {name: {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 4]}},
        "entry not an object": {name: "F32"},
        "dtype not a string": {name: {"dtype": ["F32"], "shape": shape, "data_offsets": [0, 4]}},
    }
    for label, header in cases.items():
        full = {**{k: {"dtype": "F32", "shape": list(v.shape), "data_offsets": [0, 0]} for k, v in good.items()}}
        full.update(header)
        r = upload(client, body, h, _payload_with_header(full))
        assert r.status_code == 422, (label, r.status_code, r.text)
    r = upload(client, body, h, struct.pack("<Q", 32 << 20) + b" " * 100)
    assert r.status_code == 422 and "over the 65536-byte cap" in r.json()["detail"]
    assert client.get("/v1/contributions", headers=A).json()["count"] == 0
    assert upload(client, body, h, good).status_code == 200  # and the lease still delivers


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"lease_ttl_s": 1e300}, "lease_ttl_s"),
        ({"round_deadline_s": 1e300}, "round_deadline_s"),
        ({"seed": 2**64}, "seed"),
        ({"max_lease_s": 10, "lease_ttl_s": 60}, None),
        ({"model": {"d_model": 4096, "n_layers": 64}, "layout": "embed:shared, b0-63:shared, head:shared"}, None),
        ({"model": {"d_model": 10**9}}, "d_model"),
        ({"outer": {"max_norm": 0}}, "max_norm"),
    ],
)
def test_run_settings_are_bounded(client: TestClient, change: dict[str, Any], field: str | None) -> None:
    r = client.post("/v1/runs", json={"name": "bounded", **change}, headers=A)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    if field is not None:
        assert detail[0]["loc"][-1] == field
    else:
        assert "max_lease_s" in json.dumps(detail) or "over the coordinator's budget" in json.dumps(detail)
    assert client.get("/v1/runs", headers=A).json()["count"] == 0


def test_non_finite_numbers_in_a_run_spec_are_refused(client: TestClient) -> None:
    """1e309 parses as inf; it used to be stored as invalid JSON and served back as null."""
    body = '{"name": "inf", "inner": {"lr": 1e309}}'
    r = client.post("/v1/runs", content=body, headers={**A, "Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "inner", "lr"]
    assert client.get("/v1/runs", headers=A).json()["count"] == 0


def test_one_lease_per_island_unless_its_capabilities_say_more(client: TestClient) -> None:
    create_running_run(client)
    island_id, h = join(client, "greedy")
    first = lease(client, island_id, h)
    assert first is not None
    second = client.post(f"/v1/islands/{island_id}/lease", headers=h)
    assert second.status_code == 409
    assert second.json()["detail"] == (
        f"island {island_id} already holds 1 lease(s) ({first['lease_id']}), as many as it may at once; "
        "upload or release one first"
    )
    wide_id, wh = join(client, "two-gpus", max_leases=2)
    assert lease(client, wide_id, wh) is not None and lease(client, wide_id, wh) is not None
    assert client.post(f"/v1/islands/{wide_id}/lease", headers=wh).status_code == 409
    greedy = client.post("/v1/islands", json={"name": "liar", "capabilities": {"max_leases": 65}}, headers=J)
    assert greedy.status_code == 422  # capabilities are bounded too


def test_heartbeats_do_not_hold_a_lease_past_its_lifetime(client: TestClient, clock: FakeClock) -> None:
    create_running_run(client, lease_ttl_s=30, max_lease_s=60)
    island_id, h = join(client)
    held = lease(client, island_id, h)
    assert held is not None
    other_id, oh = join(client, "other")
    for _ in range(2):  # heartbeats every 25 s keep it alive until its lifetime is up
        clock.advance(25)
        beat = client.post(f"/v1/islands/{island_id}/heartbeat", headers=h).json()
        assert beat["active_lease_ids"] == [held["lease_id"]]
    clock.advance(25)  # t = 75 > 60: no longer listed, whatever the heartbeats
    assert client.post(f"/v1/islands/{island_id}/heartbeat", headers=h).json()["active_lease_ids"] == []
    taken = [lease(client, other_id, oh)]
    assert taken[0] is not None  # its path is free again (4 paths: the other island gets one either way)
    assert client.get(f"/v1/runs/{held['run_id']}", headers=A).json()["max_lease_s"] == 60


def test_redact_url_hides_passwords_only() -> None:
    assert (
        redact_url("postgresql+psycopg://user:s3cret@db:5432/dipaco") == "postgresql+psycopg://user:***@db:5432/dipaco"
    )
    assert redact_url("sqlite:////data/dipaco.db") == "sqlite:////data/dipaco.db"
    assert redact_url("s3://bucket/prefix") == "s3://bucket/prefix"
    assert redact_url("/var/lib/dipaco/blobs") == "/var/lib/dipaco/blobs"


def test_tokens_file_is_private_and_checked(tmp_path: Path) -> None:
    data = tmp_path / "fresh"
    settings = Settings(data_dir=data)
    tokens = load_service_tokens(settings)
    assert tokens.generated_file == (data / "tokens.json").resolve()
    assert data.stat().st_mode & 0o777 == 0o700
    assert tokens.generated_file.stat().st_mode & 0o777 == 0o600
    tokens.generated_file.chmod(0o644)  # opened up by hand: put back
    load_service_tokens(settings)
    assert tokens.generated_file.stat().st_mode & 0o777 == 0o600
    tokens.generated_file.write_text(json.dumps({"admin_token": "short", "join_token": "j" * 20}))
    with pytest.raises(TokenFileError, match="admin_token must be at least 16 characters"):
        load_service_tokens(settings)
    tokens.generated_file.write_text("not json")
    with pytest.raises(TokenFileError, match="cannot read the tokens"):
        load_service_tokens(settings)


def test_spool_left_by_a_dead_process_is_removed_at_start(tmp_path: Path) -> None:
    root = tmp_path / "spool"
    host = socket.gethostname()
    dead = root / f"{host}-999999999"
    dead.mkdir(parents=True)
    (dead / "abc.upload").write_bytes(b"x" * 100)
    alive = root / f"{host}-{os.getppid()}"  # another live process on this host: left alone
    alive.mkdir()
    (alive / "def.upload").write_bytes(b"y")
    other_host = root / "elsewhere-1"
    other_host.mkdir()
    (root / "old.upload").write_bytes(b"z")  # the flat layout of earlier versions
    mine = process_spool(root)
    assert mine == root / f"{host}-{os.getpid()}" and mine.is_dir()
    assert not dead.exists() and not (root / "old.upload").exists()
    assert (alive / "def.upload").exists() and other_host.exists()


def test_weights_and_training_data_are_for_the_runs_islands_and_the_admin(client: TestClient) -> None:
    run = create_running_run(client)
    module = client.get(f"/v1/modules?run_id={run['id']}", headers=A).json()["data"][0]
    shard_id = client.get(f"/v1/paths?run_id={run['id']}", headers=A).json()["data"][0]["shard_id"]
    weights, tokens = f"/v1/modules/{module['id']}/weights", f"/v1/shards/{shard_id}/tokens"
    # the join token every island operator holds: metadata yes, data no
    assert client.get(f"/v1/runs/{run['id']}", headers=J).status_code == 200
    for url in (weights, tokens):
        r = client.get(url, headers=J)
        assert r.status_code == 403 and "need an admin token or the token of an island of the run" in r.json()["detail"]
    outsider_id, oh = join(client, "outsider")
    r = client.get(weights, headers=oh)
    assert r.status_code == 403
    assert r.json()["detail"] == (
        f"island {outsider_id} has no lease in run {run['id']}: module weights are for the run's islands and the admin"
    )
    island_id, h = join(client, "member")
    assert lease(client, island_id, h) is not None
    for headers in (h, A):
        assert client.get(weights, headers=headers).status_code == 200
        assert client.get(tokens, headers=headers).status_code == 200


def test_metrics_take_a_token_when_one_is_set(settings: Settings, clock: FakeClock) -> None:
    with TestClient(create_app(settings, clock=clock)) as client:
        assert client.get("/metrics").status_code == 200  # open by default, for scrapers
    settings.metrics_token = SecretStr("metrics-token-0123456789")
    with TestClient(create_app(settings, clock=clock)) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
        ok = client.get("/metrics", headers={"Authorization": "Bearer metrics-token-0123456789"})
        assert ok.status_code == 200 and "dipaco_rounds_applied_total" in ok.text


def test_the_openapi_document_lists_the_errors_each_operation_gives(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            codes = set(operation["responses"])
            if path.startswith("/v1/"):
                assert {"401", "413", "422"} <= codes, (method, path, codes)
    upload_codes = set(spec["paths"]["/v1/leases/{lease_id}/outer-gradients"]["post"]["responses"])
    assert {"200", "401", "403", "404", "409", "413", "422"} <= upload_codes


def test_an_upload_for_a_huge_lease_id_or_with_an_empty_body_is_4xx(client: TestClient) -> None:
    create_running_run(client)
    island_id, h = join(client)
    body = lease(client, island_id, h)
    assert body is not None
    empty = upload(client, body, h, b"")
    assert empty.status_code == 422
    ghost = upload(client, {**body, "lease_id": 10**12}, h, encode({"x": torch.zeros(1)}))
    assert ghost.status_code == 404 and ghost.json()["detail"] == "lease 1000000000000 does not exist"
