from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from router.cli import RegistrationError, app, register_shards
from router.shards import shard_corpus

runner = CliRunner()


def test_public_commands() -> None:
    names = sorted(c.name or (c.callback.__name__ if c.callback else "") for c in app.registered_commands)
    assert names == ["corpus", "refit", "register", "shard"]


def test_corpus_and_shard_commands(tmp_path: Path) -> None:
    result = runner.invoke(app, ["corpus", "--out", str(tmp_path / "c"), "--max-docs-per-domain", "12"])
    assert result.exit_code == 0, result.output
    assert "train docs" in result.output and "total" in result.output
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    for domain in manifest["domains"]:
        assert domain in result.output

    result = runner.invoke(app, ["shard", "--corpus", str(tmp_path / "c"), "--out", str(tmp_path / "s"),
                                 "--paths", "2", "--prefix-tokens", "24", "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert "purity" in result.output and "random assignment" in result.output
    shards = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert (shards["num_paths"], shards["prefix_tokens"], shards["seed"]) == (2, 24, 3)


def test_shard_without_corpus_fails_cleanly(tmp_path: Path) -> None:
    result = runner.invoke(app, ["shard", "--corpus", str(tmp_path / "none"), "--out", str(tmp_path / "s"),
                                 "--paths", "2"])
    assert result.exit_code == 1
    assert "no corpus manifest" in result.output


class FakeCoordinator:
    """Stores shard uploads like the coordinator's shard route, keyed by (run, path)."""

    def __init__(self, *, corrupt_hash: bool = False) -> None:
        self.bodies: dict[tuple[int, int], bytes] = {}
        self.corrupt_hash = corrupt_hash

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != "Bearer admin-secret":
            return httpx.Response(401, json={"detail": "admin token required"})
        _, _, _, run, _, index = request.url.path.split("/")
        if run != "7":
            return httpx.Response(404, json={"detail": f"run {run} not found"})
        assert request.headers["content-type"] == "application/octet-stream"
        body = request.read()
        self.bodies[(int(run), int(index))] = body
        digest = hashlib.sha256(body).hexdigest()
        return httpx.Response(201, json={
            "id": len(self.bodies), "run_id": int(run), "path_index": int(index),
            "tokens_hash": "0" * 64 if self.corrupt_hash else digest, "num_tokens": len(body) // 2,
            "num_documents": int(request.url.params["num_documents"]),
        })


@pytest.fixture(scope="module")
def small_shards(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards2")
    shard_corpus(corpus_dir, out, num_paths=2)
    return out


def _client(handler: FakeCoordinator, token: str = "admin-secret") -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(handler), base_url="http://coord",
                        headers={"Authorization": f"Bearer {token}"})


def test_register_shards_uploads_every_file(small_shards: Path) -> None:
    fake = FakeCoordinator()
    with _client(fake) as client:
        records = register_shards(small_shards, client=client, run_id=7)
    manifest = json.loads((small_shards / "manifest.json").read_text())
    assert [r["path_index"] for r in records] == [0, 1]
    for shard, record in zip(manifest["shards"], records, strict=True):
        assert fake.bodies[(7, shard["path_index"])] == (small_shards / shard["file"]).read_bytes()
        assert record["tokens_hash"] == shard["sha256"]
        assert record["num_documents"] == shard["num_documents"]


def test_register_reports_detail_and_hash_mismatch(small_shards: Path) -> None:
    with _client(FakeCoordinator()) as client, pytest.raises(RegistrationError, match="HTTP 404: run 8 not found"):
        register_shards(small_shards, client=client, run_id=8)
    with _client(FakeCoordinator(corrupt_hash=True)) as client, pytest.raises(
        RegistrationError, match="coordinator stored tokens_hash 0+, manifest says"
    ):
        register_shards(small_shards, client=client, run_id=7)


def test_register_command_needs_a_token(small_shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DIPACO_ADMIN_TOKEN", raising=False)
    result = runner.invoke(app, ["register", "--shards", str(small_shards), "--coordinator", "http://x",
                                 "--run", "1"])
    assert result.exit_code == 1
    assert "DIPACO_ADMIN_TOKEN" in result.output


def test_register_command_unreachable_coordinator(small_shards: Path) -> None:
    # Port 9 on loopback: nothing listens, the connection is refused at once (no traffic leaves the host).
    result = runner.invoke(app, ["register", "--shards", str(small_shards), "--coordinator",
                                 "http://127.0.0.1:9", "--run", "1", "--token", "t"])
    assert result.exit_code == 1
    assert "cannot reach coordinator" in result.output
