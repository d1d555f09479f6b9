"""`dipaco eval` and `dipaco.evaluation`: a run's paths read through the typed client from the real app."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from coordinator.app import create_app
from coordinator.client import CoordinatorClient, RequestRejected, RetryPolicy
from coordinator.settings import Settings
from dipaco.cli import app
from dipaco.evaluation import EvalError, evaluate_run, find_tokenizer, load_router
from modules import ModelConfig, build_path, init_level_modules, parse_layout
from router.corpus import iter_jsonl
from router.evaluate import evaluate_routed
from router.shards import ShardOptions, shard_corpus
from tests.conftest import ADMIN, JOIN
from tests.coordinator.helpers import A, create_running_run
from tests.router.conftest import corpus_dir, shards4  # noqa: F401  (fixtures)

RUN = {"model": {"flavour": "debug", "d_model": 32, "seq_len": 48, "n_heads": 2, "n_layers": 2}}


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[TestClient]:
    """The app in-process; the raw client carries the admin token for the helpers that set runs up."""
    settings = Settings(
        data_dir=tmp_path / "coord", database_url=f"sqlite:///{tmp_path / 'r.db'}", admin_token=ADMIN, join_token=JOIN
    )  # type: ignore[arg-type]
    with TestClient(create_app(settings)) as client:
        client.headers.update(A)
        yield client


@pytest.fixture
def reader(coordinator: TestClient) -> CoordinatorClient:
    """The typed client on the app, as a command makes it (one attempt)."""
    return CoordinatorClient("http://testserver", ADMIN, http=coordinator, retry=RetryPolicy.once())


@pytest.fixture(scope="module")
def heldout(corpus_dir: Path) -> list[str]:  # noqa: F811
    return [d["text"] for d in iter_jsonl(corpus_dir / "heldout.jsonl")][:30]


def test_evaluate_run_matches_local_paths(
    coordinator: TestClient,
    reader: CoordinatorClient,
    shards4: tuple[Path, dict[str, Any]],  # noqa: F811
    heldout: list[str],
) -> None:
    run = create_running_run(coordinator, **RUN)
    router = load_router(shards4[0])
    result = evaluate_run(reader, run_id=run["id"], router=router, documents=heldout)
    # The same paths built here from the initial weights (every module of a level starts identical).
    cfg = ModelConfig.from_dict(run["config"]["model"])
    layout = parse_layout(run["layout"], n_layers=cfg.n_layers)
    init = init_level_modules(cfg, layout, seed=0)
    local = evaluate_routed([build_path(cfg, init)] * 4, router, heldout, context=cfg.seq_len)
    assert {k: v for k, v in result.to_dict().items() if k in local.to_dict()} == local.to_dict()
    assert result.extra["module_versions"] == [[0, 0, 0, 0]] * 4 and result.extra["run_id"] == run["id"]
    assert result.num_tokens == sum(len(t.encode()) + 1 - 32 for t in heldout)


def test_router_and_run_must_agree(
    coordinator: TestClient,
    reader: CoordinatorClient,
    corpus_dir: Path,  # noqa: F811
    tmp_path: Path,
    heldout: list[str],
) -> None:
    shard_corpus(corpus_dir, tmp_path / "s2", ShardOptions(num_paths=2))
    run = create_running_run(coordinator, **RUN)
    with pytest.raises(EvalError, match=f"the router has 2 paths, run {run['id']} has 4"):
        evaluate_run(reader, run_id=run["id"], router=load_router(tmp_path / "s2"), documents=heldout)
    with pytest.raises(RequestRejected, match="HTTP 404: run 999 does not exist"):
        evaluate_run(reader, run_id=999, router=load_router(tmp_path / "s2"), documents=heldout)


def test_eval_command_table_and_json(
    coordinator: TestClient,
    corpus_dir: Path,  # noqa: F811
    tmp_path: Path,
    shards4: tuple[Path, dict[str, Any]],  # noqa: F811
) -> None:
    run = create_running_run(coordinator, **RUN)
    lines = (corpus_dir / "heldout.jsonl").read_text().splitlines(keepends=True)[:12]
    (tmp_path / "small.jsonl").write_text("".join(lines))
    args = [
        "eval",
        "--coordinator",
        "http://coord",
        "--run",
        str(run["id"]),
        "--router",
        str(shards4[0]),
        "--corpus",
        str(tmp_path),
        "--split",
        "small",
        "--token",
        ADMIN,
        "--every",
        "32",
    ]
    # the command talks through the app (ctx.obj) with the token it was given
    result = CliRunner().invoke(app, args, obj=coordinator)
    assert result.exit_code == 0, result.output
    assert "perplexity" in result.output and "re-routed every 32" in result.output
    result = CliRunner().invoke(app, [*args, "--json"], obj=coordinator)
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)  # progress lines go to stderr: stdout is the JSON alone
    assert "eval: scoring 12 small documents of run" in result.stderr
    assert body["every"] == 32 and len(body["per_path"]) == 4 and body["run_id"] == run["id"]
    assert body["num_documents"] + body["skipped_documents"] == 12
    bad_token = [a if a != ADMIN else "not-a-token" for a in args]
    result = CliRunner().invoke(app, bad_token, obj=coordinator)
    assert result.exit_code == 1 and "HTTP 401" in result.output


def test_eval_command_errors(
    corpus_dir: Path,  # noqa: F811
    shards4: tuple[Path, dict[str, Any]],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DIPACO_TOKEN", raising=False)
    monkeypatch.delenv("DIPACO_ADMIN_TOKEN", raising=False)
    base = ["eval", "--coordinator", "http://127.0.0.1:9", "--run", "1", "--router", str(shards4[0])]
    result = CliRunner().invoke(app, [*base, "--corpus", str(corpus_dir)])
    assert result.exit_code == 1 and "no token" in result.output
    result = CliRunner().invoke(app, [*base, "--corpus", str(corpus_dir), "--split", "nope", "--token", "t"])
    assert result.exit_code == 1 and "no 'nope' split" in result.output
    # port 9 on loopback: nothing listens, the connection is refused at once; one attempt, then a clear line
    result = CliRunner().invoke(app, [*base, "--corpus", str(corpus_dir), "--token", "t"])
    assert result.exit_code == 1 and "coordinator at http://127.0.0.1:9 unavailable" in result.output


def test_bpe_shards_are_evaluated_with_their_tokenizer(
    coordinator: TestClient,
    reader: CoordinatorClient,
    corpus_dir: Path,  # noqa: F811
    tmp_path: Path,
    heldout: list[str],
) -> None:
    pytest.importorskip("tokenizers", reason="the BPE tokenizer needs the `tokenizers` package")
    shard_corpus(corpus_dir, tmp_path / "bpe", ShardOptions(num_paths=4, tokenizer="bpe", vocab_size=400))
    tokenizer = find_tokenizer(tmp_path / "bpe" / "router")
    assert tokenizer is not None and tokenizer.vocab_size <= 400
    assert find_tokenizer(tmp_path) is None  # byte-level: nothing to find
    router = load_router(tmp_path / "bpe")
    small = create_running_run(coordinator, **RUN)  # vocab 257 < the tokenizer's
    with pytest.raises(EvalError, match=f"run {small['id']}'s model only 257"):
        evaluate_run(reader, run_id=small["id"], router=router, documents=heldout, tokenizer=tokenizer)
    model = {**RUN["model"], "vocab_size": 400}
    run = create_running_run(coordinator, name="bpe", model=model)
    result = evaluate_run(reader, run_id=run["id"], router=router, documents=heldout, tokenizer=tokenizer)
    expected = sum(max(0, len(tokenizer.encode(t)) + 1 - 32) for t in heldout)
    assert result.num_tokens == expected and result.num_tokens < sum(len(t.encode()) + 1 - 32 for t in heldout)
