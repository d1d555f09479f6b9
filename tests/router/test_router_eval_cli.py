from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from coordinator.app import create_app
from coordinator.settings import Settings
from modules import ModelConfig, build_path, init_level_modules, parse_layout
from router import eval_cli
from router.corpus import iter_jsonl
from router.eval_cli import EvalError, eval_command, evaluate_run, load_router
from router.evaluate import evaluate_routed
from tests.conftest import ADMIN, JOIN
from tests.coordinator.helpers import A, create_running_run

RUN = {"model": {"flavour": "debug", "d_model": 32, "seq_len": 48, "n_heads": 2, "n_layers": 2}}


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(
        data_dir=tmp_path / "coord", database_url=f"sqlite:///{tmp_path / 'r.db'}", admin_token=ADMIN, join_token=JOIN
    )  # type: ignore[arg-type]
    with TestClient(create_app(settings)) as client:
        client.headers.update(A)
        yield client


@pytest.fixture(scope="module")
def heldout(corpus_dir: Path) -> list[str]:
    return [d["text"] for d in iter_jsonl(corpus_dir / "heldout.jsonl")][:30]


def test_evaluate_run_matches_local_paths(
    coordinator: TestClient, shards4: tuple[Path, dict[str, Any]], heldout: list[str]
) -> None:
    run = create_running_run(coordinator, **RUN)
    router = load_router(shards4[0])
    result = evaluate_run(coordinator, run_id=run["id"], router=router, documents=heldout)
    # The same paths built here from the initial weights (every module of a level starts identical).
    cfg = ModelConfig.from_dict(run["config"]["model"])
    layout = parse_layout(run["layout"], n_layers=cfg.n_layers)
    init = init_level_modules(cfg, layout, seed=0)
    local = evaluate_routed([build_path(cfg, init)] * 4, router, heldout, context=cfg.seq_len)
    assert {k: v for k, v in result.to_dict().items() if k in local.to_dict()} == local.to_dict()
    assert result.extra["module_versions"] == [[0, 0, 0, 0]] * 4 and result.extra["run_id"] == run["id"]
    assert result.num_tokens == sum(len(t.encode()) + 1 - 32 for t in heldout)


def test_router_and_run_must_agree(
    coordinator: TestClient, corpus_dir: Path, tmp_path: Path, heldout: list[str]
) -> None:
    from router.shards import shard_corpus

    shard_corpus(corpus_dir, tmp_path / "s2", num_paths=2)
    run = create_running_run(coordinator, **RUN)
    with pytest.raises(EvalError, match=f"the router has 2 paths, run {run['id']} has 4"):
        evaluate_run(coordinator, run_id=run["id"], router=load_router(tmp_path / "s2"), documents=heldout)
    with pytest.raises(EvalError, match="HTTP 404"):
        evaluate_run(coordinator, run_id=999, router=load_router(tmp_path / "s2"), documents=heldout)


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("eval")(eval_command)
    return app


def test_eval_command_table_and_json(
    coordinator: TestClient,
    corpus_dir: Path,
    tmp_path: Path,
    shards4: tuple[Path, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = create_running_run(coordinator, **RUN)
    lines = (corpus_dir / "heldout.jsonl").read_text().splitlines(keepends=True)[:12]
    (tmp_path / "small.jsonl").write_text("".join(lines))

    @contextmanager
    def fake_client(url: str, token: str) -> Iterator[httpx.Client]:
        assert (url, token) == ("http://coord", "t0k")
        yield coordinator

    monkeypatch.setattr(eval_cli, "_client", fake_client)
    args = [
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
        "t0k",
        "--every",
        "32",
    ]
    result = CliRunner().invoke(_app(), args)
    assert result.exit_code == 0, result.output
    assert "perplexity" in result.output and "re-routed every 32" in result.output
    result = CliRunner().invoke(_app(), [*args, "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert body["every"] == 32 and len(body["per_path"]) == 4 and body["run_id"] == run["id"]
    assert body["num_documents"] + body["skipped_documents"] == 12


def test_eval_command_errors(
    corpus_dir: Path, shards4: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DIPACO_TOKEN", raising=False)
    monkeypatch.delenv("DIPACO_ADMIN_TOKEN", raising=False)
    base = ["--coordinator", "http://127.0.0.1:9", "--run", "1", "--router", str(shards4[0])]
    result = CliRunner().invoke(_app(), [*base, "--corpus", str(corpus_dir)])
    assert result.exit_code == 1 and "no token" in result.output
    result = CliRunner().invoke(_app(), [*base, "--corpus", str(corpus_dir), "--split", "nope", "--token", "t"])
    assert result.exit_code == 1 and "no 'nope' split" in result.output
    result = CliRunner().invoke(_app(), [*base, "--corpus", str(corpus_dir), "--token", "t"])
    assert result.exit_code == 1 and "cannot reach the coordinator" in result.output


def test_bpe_shards_are_evaluated_with_their_tokenizer(
    coordinator: TestClient, corpus_dir: Path, tmp_path: Path, heldout: list[str]
) -> None:
    pytest.importorskip("tokenizers", reason="the BPE tokenizer needs the `tokenizers` package")
    from router.eval_cli import find_tokenizer
    from router.shards import shard_corpus

    shard_corpus(corpus_dir, tmp_path / "bpe", num_paths=4, tokenizer="bpe", vocab_size=400)
    tokenizer = find_tokenizer(tmp_path / "bpe" / "router")
    assert tokenizer is not None and tokenizer.vocab_size <= 400
    assert find_tokenizer(tmp_path) is None  # byte-level: nothing to find
    router = load_router(tmp_path / "bpe")
    small = create_running_run(coordinator, **RUN)  # vocab 257 < the tokenizer's
    with pytest.raises(EvalError, match=f"run {small['id']}'s model only 257"):
        evaluate_run(coordinator, run_id=small["id"], router=router, documents=heldout, tokenizer=tokenizer)
    model = {**RUN["model"], "vocab_size": 400}
    run = create_running_run(coordinator, name="bpe", model=model)
    result = evaluate_run(coordinator, run_id=run["id"], router=router, documents=heldout, tokenizer=tokenizer)
    expected = sum(max(0, len(tokenizer.encode(t)) + 1 - 32) for t in heldout)
    assert result.num_tokens == expected and result.num_tokens < sum(len(t.encode()) + 1 - 32 for t in heldout)
