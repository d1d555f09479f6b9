"""`dipaco router register` and `dipaco router refit` (`dipaco.router_commands`): the router commands that talk
to the coordinator, through the typed client, against a fake transport and the real app."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from coordinator.app import create_app
from coordinator.client import CoordinatorClient, RequestRejected, RetryPolicy
from coordinator.settings import Settings
from coordinator.states import RunStatus
from dipaco.cli import app
from dipaco.router_commands import RegistrationError, register_shards
from router.router import Router
from router.shards import ShardOptions, load_manifest, shard_corpus
from tests.conftest import ADMIN, JOIN
from tests.coordinator.helpers import A, create_running_run
from tests.router.conftest import corpus_dir, shards4  # noqa: F401  (fixtures)

runner = CliRunner()
RUN = {"model": {"flavour": "debug", "d_model": 32, "seq_len": 48, "n_heads": 2, "n_layers": 2}}


FAKE_RUN = {
    "id": 7,
    "name": "fake",
    "status": "waiting_for_shards",
    "current_round": 0,
    "num_rounds": 1,
    "num_paths": 2,
    "inner_steps": 1,
    "layout": "embed:shared, b0-1:routed2, head:shared",
    "config": {"model": {"seq_len": 48}, "heldout_tokens": 0},
    "lease_ttl_s": 60.0,
    "max_lease_s": 600.0,
    "quorum": 1.0,
    "round_deadline_s": None,
    "created_at": "2026-12-01T00:00:00Z",
}


class FakeCoordinator:
    """Stores shard uploads like the coordinator's shard route, keyed by (run, path)."""

    def __init__(self, *, corrupt_hash: bool = False) -> None:
        self.bodies: dict[tuple[int, int], bytes] = {}
        self.requests: list[httpx.Request] = []
        self.corrupt_hash = corrupt_hash

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.headers.get("authorization") != "Bearer admin-secret":
            return httpx.Response(401, json={"detail": "admin token required"})
        if request.method == "GET":  # the run: register reads whether it keeps held-out slices
            run = request.url.path.rsplit("/", 1)[1]
            if run != "7":
                return httpx.Response(404, json={"detail": f"run {run} not found"})
            return httpx.Response(200, json=FAKE_RUN)
        _, _, _, run, _, index = request.url.path.split("/")
        if run != "7":
            return httpx.Response(404, json={"detail": f"run {run} not found"})
        assert request.headers["content-type"] == "application/octet-stream"
        body = request.read()
        self.bodies[(int(run), int(index))] = body
        digest = hashlib.sha256(body).hexdigest()
        return httpx.Response(
            201,
            json={
                "id": len(self.bodies),
                "run_id": int(run),
                "path_index": int(index),
                "tokens_hash": "0" * 64 if self.corrupt_hash else digest,
                "num_tokens": len(body) // 2,
                "num_documents": int(request.url.params["num_documents"]),
            },
        )


@pytest.fixture(scope="module")
def small_shards(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("shards2")
    shard_corpus(corpus_dir, out, ShardOptions(num_paths=2))
    return out


def fake_client(handler: FakeCoordinator, token: str = "admin-secret") -> CoordinatorClient:
    http = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://coord")
    return CoordinatorClient("http://coord", token, http=http, retry=RetryPolicy.once())


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(
        data_dir=tmp_path / "coord", database_url=f"sqlite:///{tmp_path / 'r.db'}", admin_token=ADMIN, join_token=JOIN
    )  # type: ignore[arg-type]
    with TestClient(create_app(settings)) as client:
        client.headers.update(A)
        yield client


def test_register_shards_uploads_every_file(small_shards: Path) -> None:
    fake = FakeCoordinator()
    with fake_client(fake) as client:
        records = register_shards(small_shards, client=client, run_id=7)
    manifest = json.loads((small_shards / "manifest.json").read_text())
    assert [r.path_index for r in records] == [0, 1]
    uploads = [r for r in fake.requests if r.method == "POST"]
    for shard, record, request in zip(manifest["shards"], records, uploads, strict=True):
        body = (small_shards / shard["file"]).read_bytes()
        assert fake.bodies[(7, shard["path_index"])] == body
        assert request.headers["content-length"] == str(len(body))  # streamed, not chunk-encoded
        assert record.tokens_hash == shard["sha256"]
        assert record.num_documents == shard["num_documents"]


def test_register_reports_detail_and_hash_mismatch(small_shards: Path) -> None:
    with fake_client(FakeCoordinator()) as client, pytest.raises(RequestRejected, match="HTTP 404: run 8 not found"):
        register_shards(small_shards, client=client, run_id=8)
    with (
        fake_client(FakeCoordinator(corrupt_hash=True)) as client,
        pytest.raises(RegistrationError, match="coordinator stored tokens_hash 0+, manifest says"),
    ):
        register_shards(small_shards, client=client, run_id=7)


def test_register_command_starts_the_run(small_shards: Path, coordinator: TestClient) -> None:
    admin = CoordinatorClient("http://testserver", ADMIN, http=coordinator, retry=RetryPolicy.once())
    run = admin.create_run({**RUN, "name": "two", "layout": "embed:shared, b0-1:routed2, head:shared"})
    args = ["router", "register", "--shards", str(small_shards), "--coordinator", "http://coord",
            "--run", str(run.id), "--token", ADMIN]  # fmt: skip
    result = runner.invoke(app, args, obj=coordinator)
    assert result.exit_code == 0, result.output
    assert f"shards of run {run.id}" in result.output
    assert admin.run(run.id).status == RunStatus.RUNNING
    assert f"run {run.id} 'two' is running: round 0 of {run.num_rounds} is open" in result.output
    again = runner.invoke(app, args, obj=coordinator)  # the run has started: the coordinator says no
    assert again.exit_code == 1 and "HTTP 409" in again.output


def test_register_command_needs_a_token(small_shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DIPACO_ADMIN_TOKEN", raising=False)
    result = runner.invoke(
        app, ["router", "register", "--shards", str(small_shards), "--coordinator", "http://x", "--run", "1"]
    )
    assert result.exit_code == 1
    assert "DIPACO_ADMIN_TOKEN" in result.output


def test_register_command_unreachable_coordinator(small_shards: Path) -> None:
    # Port 9 on loopback: nothing listens, the connection is refused at once (no traffic leaves the host).
    args = ["router", "register", "--shards", str(small_shards), "--coordinator", "http://127.0.0.1:9",
            "--run", "1", "--token", "t"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert "coordinator at http://127.0.0.1:9 unavailable" in result.output


def test_refit_command(
    coordinator: TestClient,
    corpus_dir: Path,  # noqa: F811
    tmp_path: Path,
    shards4: tuple[Path, dict[str, Any]],  # noqa: F811
) -> None:
    run = create_running_run(coordinator, **RUN)
    lines = (corpus_dir / "heldout.jsonl").read_text().splitlines(keepends=True)[:24]
    small = tmp_path / "corpus"
    small.mkdir()
    for name in ("manifest.json", "train.jsonl"):
        (small / name).write_bytes((corpus_dir / name).read_bytes())
    (small / "heldout.jsonl").write_text("".join(lines))
    args = ["router", "refit", "--coordinator", "http://coord", "--run", str(run["id"]), "--router",
            str(shards4[0]), "--corpus", str(small), "--out", str(tmp_path / "refit"), "--token", ADMIN,
            "--shards-out", str(tmp_path / "shards")]  # fmt: skip
    result = runner.invoke(app, args, obj=coordinator)
    assert result.exit_code == 0, result.output
    assert "documents change path" in result.output and "perplexity: base" in result.output
    new = Router.load(tmp_path / "refit")
    assert new.head_weight is not None and new.num_paths == 4
    manifest = load_manifest(tmp_path / "shards")
    assert manifest["router_given"] is True and manifest["fit_documents"] == 0
    assert Router.load(tmp_path / "shards" / "router").head_weight is not None
    # A 2-path router against a 4-path run is refused.
    shard_corpus(corpus_dir, tmp_path / "s2", ShardOptions(num_paths=2))
    bad = [*args[:7], str(tmp_path / "s2"), *args[8:]]
    result = runner.invoke(app, bad, obj=coordinator)
    assert result.exit_code == 1 and "the router has 2 paths" in result.output


@pytest.fixture(scope="module")
def shards_with_heldout(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("shards-heldout")
    shard_corpus(corpus_dir, out, ShardOptions(num_paths=2, heldout_docs_per_shard=2))
    return out


@pytest.mark.parametrize("heldout_tokens", [4096, 0])
def test_register_uploads_held_out_slices_when_the_run_keeps_them(
    shards_with_heldout: Path, coordinator: TestClient, heldout_tokens: int
) -> None:
    admin = CoordinatorClient("http://testserver", ADMIN, http=coordinator, retry=RetryPolicy.once())
    layout = "embed:shared, b0-1:routed2, head:shared"
    run = admin.create_run(
        {**RUN, "name": f"held-{heldout_tokens}", "layout": layout, "heldout_tokens": heldout_tokens}
    )
    args = ["router", "register", "--shards", str(shards_with_heldout), "--coordinator", "http://coord",
            "--run", str(run.id), "--token", ADMIN]  # fmt: skip
    result = runner.invoke(app, args, obj=coordinator)
    assert result.exit_code == 0, result.output
    manifest = load_manifest(shards_with_heldout)
    island = CoordinatorClient("http://testserver", JOIN, http=coordinator, retry=RetryPolicy.once())
    island.join("reader")
    lease = island.lease()
    assert lease is not None
    if heldout_tokens:
        assert "held-out slices uploaded for 2 of 2 paths (2 documents per shard)" in " ".join(result.output.split())
        held = manifest["shards"][lease.path_index]["heldout"]
        assert lease.heldout is not None and lease.heldout.tokens_hash == held["sha256"]
        body = island.heldout_tokens(lease.heldout.shard_id, lease.heldout.tokens_hash)
        assert body == (shards_with_heldout / held["file"]).read_bytes()
    else:
        assert f"run {run.id} keeps none (created with heldout_tokens 0)" in " ".join(result.output.split())
        assert lease.heldout is None
