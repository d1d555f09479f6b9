"""`dipaco export` / `dipaco generate`: a path exported from a real coordinator app loads and samples without it."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors import safe_open
from typer.testing import CliRunner

from coordinator.app import create_app
from coordinator.client import CoordinatorClient, RetryPolicy
from coordinator.settings import Settings
from dipaco.cli import app
from dipaco.export import ExportError, export_path, generate, load_exported, save_export
from modules import ModelConfig, build_path, decode, init_state
from router.corpus import build_local_corpus
from router.shards import ShardOptions, shard_corpus
from tests.conftest import ADMIN, JOIN
from tests.coordinator.helpers import A, create_running_run, join, lease, train_lease, upload, wait_applied

RUN: dict[str, Any] = {"model": {"flavour": "debug", "d_model": 32, "seq_len": 16, "n_heads": 2, "n_layers": 2}}


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(
        data_dir=tmp_path / "coord", database_url=f"sqlite:///{tmp_path / 'c.db'}", admin_token=ADMIN, join_token=JOIN
    )  # type: ignore[arg-type]
    with TestClient(create_app(settings)) as client:
        client.headers.update(A)
        yield client


def typed(coordinator: TestClient) -> CoordinatorClient:
    return CoordinatorClient("http://testserver", ADMIN, http=coordinator, retry=RetryPolicy.once())


def _train_one_round(client: TestClient, block: dict[str, Any] | None = None) -> dict[str, Any]:
    """A running 2x2 run with round 0 applied (every path trained by the helpers' fake island); `block`: the
    run's block style fields (POST /v1/runs `model.block`, `model.tie_embeddings`)."""
    run = create_running_run(client, model={**RUN["model"], **(block or {})})
    island, headers = join(client)
    for _ in range(run["num_paths"]):
        body = lease(client, island, headers)
        assert body is not None
        assert upload(client, body, headers, train_lease(client, body, headers)).status_code == 200
    run = wait_applied(client, run["id"])  # the apply executors apply the round after the last upload's answer
    assert run["current_round"] == 1
    return dict(run)


def _path_weights(client: TestClient, run_id: int, path_index: int) -> dict[str, torch.Tensor]:
    path = client.get("/v1/paths", params={"run_id": run_id}).json()["data"][path_index]
    state: dict[str, torch.Tensor] = {}
    for mid in path["module_ids"]:
        state.update(decode(client.get(f"/v1/modules/{mid}/weights").content))
    return state


BLOCKS = pytest.mark.parametrize(
    "block",
    [{"block": "gpt2"}, {"block": "llama"}, {"block": "llama", "tie_embeddings": True}],
    ids=["gpt2", "llama", "llama-tied"],
)


@BLOCKS
def test_export_loads_without_the_coordinator(coordinator: TestClient, tmp_path: Path, block: dict[str, Any]) -> None:
    run = _train_one_round(coordinator, block)
    out = tmp_path / "export"
    provenance = export_path(typed(coordinator), run_id=run["id"], path_index=2, out_dir=out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [m["version"] for m in provenance["modules"]] == [1, 1, 1, 1] and provenance["path_index"] == 2
    expected = _path_weights(coordinator, run["id"], 2)
    coordinator.close()  # nothing below talks to the coordinator

    model = load_exported(out)
    cfg = ModelConfig.from_dict(json.loads((out / "config.json").read_text()))
    assert model.cfg == cfg == ModelConfig.from_dict(run["config"]["model"])
    assert cfg.block == block["block"] and cfg.tie_embeddings == block.get("tie_embeddings", False)
    assert ("lm_head.weight" in model.state_dict()) != cfg.tie_embeddings
    assert ("pos_emb.weight" in model.state_dict()) == (cfg.block == "gpt2")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        meta = json.loads(fh.metadata()["dipaco"])
    assert meta["run_id"] == run["id"] and meta["layout"] == run["layout"]
    # The same logits as the path composed from the module blobs.
    x = torch.randint(0, 256, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    ref = build_path(cfg, [expected]).eval()
    assert torch.equal(model(x), ref(x))


def test_export_errors(coordinator: TestClient, tmp_path: Path) -> None:
    run = create_running_run(coordinator, **RUN)
    with pytest.raises(ExportError, match="has 4 path\\(s\\); path 7 does not exist"):
        export_path(typed(coordinator), run_id=run["id"], path_index=7, out_dir=tmp_path / "x")
    with pytest.raises(ExportError, match="no export in"):
        load_exported(tmp_path / "nothing")


def test_export_files_get_the_same_mode(tmp_path: Path) -> None:
    """Both files get the mode of an ordinary new file here (the umask's), whatever the safetensors writer uses."""
    cfg = ModelConfig(d_model=32, n_heads=2, seq_len=16, n_layers=1)
    old = os.umask(0o027)
    try:
        save_export(tmp_path, cfg, init_state(cfg, seed=0))
    finally:
        os.umask(old)
    modes = {stat.S_IMODE((tmp_path / name).stat().st_mode) for name in ("model.safetensors", "config.json")}
    assert modes == {0o640}


def test_a_config_without_block_loads_as_gpt2(tmp_path: Path) -> None:
    # exports written before `block` existed are gpt2 paths, whatever the default block is now
    cfg = ModelConfig(d_model=32, n_heads=2, seq_len=16, n_layers=1, block="gpt2")
    save_export(tmp_path, cfg, init_state(cfg, seed=0))
    legacy = {k: v for k, v in cfg.to_dict().items() if k not in ("block", "tie_embeddings")}
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    assert load_exported(tmp_path).cfg == cfg


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_generate_at_and_past_seq_len(block: str) -> None:
    # the window slides once the prompt reaches seq_len; positions (learned or rotary) restart at its first token
    cfg = ModelConfig(d_model=32, n_heads=2, seq_len=16, n_layers=1, block=block)  # type: ignore[arg-type]
    model = build_path(cfg, [init_state(cfg, seed=1)]).eval()
    for length in (cfg.seq_len - 1, cfg.seq_len, cfg.seq_len + 5):
        prompt = [(7 * i) % 256 for i in range(length)]
        got = generate(model, prompt, max_new_tokens=3, temperature=0.0, stop_at_eos=False)
        ids = list(prompt)
        for _ in range(3):
            ids.append(int(model(torch.tensor([ids[-cfg.seq_len :]]))[0, -1].argmax()))
        assert got == ids[length:], length


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_generate_is_deterministic_per_seed(block: str) -> None:
    cfg = ModelConfig(d_model=32, n_heads=2, seq_len=16, n_layers=1, block=block)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = build_path(cfg, [init_state(cfg, seed=1)])
    prompt = list(b"def main():")
    a = generate(model, prompt, max_new_tokens=40, temperature=1.0, seed=3, stop_at_eos=False)
    b = generate(model, prompt, max_new_tokens=40, temperature=1.0, seed=3, stop_at_eos=False)
    c = generate(model, prompt, max_new_tokens=40, temperature=1.0, seed=4, stop_at_eos=False)
    assert a == b and a != c and len(a) == 40  # longer than seq_len: the context window slides
    greedy = generate(model, prompt, max_new_tokens=5, temperature=0.0, seed=0, stop_at_eos=False)
    assert greedy == generate(model, prompt, max_new_tokens=5, temperature=0.0, seed=99, stop_at_eos=False)
    assert greedy[0] == int(model(torch.tensor([prompt]))[0, -1].argmax())
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompt, max_new_tokens=1, temperature=-1)


def test_export_and_generate_commands(coordinator: TestClient, tmp_path: Path) -> None:
    run = _train_one_round(coordinator)
    out = tmp_path / "exp"
    args = [
        "export",
        "--coordinator",
        "http://coord",
        "--run",
        str(run["id"]),
        "--path",
        "1",
        "--out",
        str(out),
        "--token",
        ADMIN,
    ]
    # the commands talk through the app (ctx.obj) with the token they were given
    result = CliRunner().invoke(app, args, obj=coordinator)
    assert result.exit_code == 0, result.output
    assert "exported run" in result.output and (out / "config.json").is_file()

    gen = ["generate", "--from", str(out), "--prompt", "int main", "--max-new-tokens", "12", "--seed", "5"]
    first, second = CliRunner().invoke(app, gen), CliRunner().invoke(app, gen)
    assert first.exit_code == 0, first.output
    assert first.output == second.output and "int main" in first.output

    # With routing: a 4-path router over a tiny local corpus; the prompt's prefix picks the path.
    build_local_corpus(tmp_path / "corpus", max_docs_per_domain=12)
    shard_corpus(tmp_path / "corpus", tmp_path / "shards", ShardOptions(num_paths=4))
    routed = [
        "generate",
        "--coordinator",
        "http://coord",
        "--run",
        str(run["id"]),
        "--router",
        str(tmp_path / "shards"),
        "--prompt",
        "#include <stdio.h>",
        "--max-new-tokens",
        "8",
        "--token",
        ADMIN,
    ]
    result = CliRunner().invoke(app, routed, obj=coordinator)
    assert result.exit_code == 0, result.output
    assert "routed by the prompt" in result.output

    bad = CliRunner().invoke(app, ["generate", "--prompt", "x"])
    assert bad.exit_code == 1 and "give --from DIR" in bad.output
    bad = CliRunner().invoke(app, [a if a != "1" else "9" for a in args], obj=coordinator)
    assert bad.exit_code == 1 and "does not exist" in bad.output


def test_generate_from_an_export_uses_its_bpe_tokenizer(tmp_path: Path) -> None:
    """A model trained on BPE shards samples BPE ids: the tokenizer in the export directory (or --tokenizer)
    encodes the prompt and decodes the sample; without one the model is refused instead of printing bytes."""
    pytest.importorskip("tokenizers", reason="the BPE tokenizer needs the `tokenizers` package")
    from router.bpe import TOKENIZER_FILE, train_bpe

    tok = train_bpe((f"the cat sat on mat number {i}. " * 3 for i in range(200)), vocab_size=300)
    cfg = ModelConfig(d_model=32, n_heads=2, seq_len=16, n_layers=1, vocab_size=tok.vocab_size)
    save_export(tmp_path / "bare", cfg, init_state(cfg, seed=0))
    runner = CliRunner()
    refused = runner.invoke(app, ["generate", "--from", str(tmp_path / "bare"), "--prompt", "the cat"])
    assert refused.exit_code != 0 and "trained on BPE shards: pass --tokenizer" in refused.output
    args = ["generate", "--from", str(tmp_path / "bare"), "--prompt", "the cat", "--max-new-tokens", "5"]
    tok.save(tmp_path / TOKENIZER_FILE)
    got = runner.invoke(app, [*args, "--tokenizer", str(tmp_path / TOKENIZER_FILE), "--temperature", "0"])
    assert got.exit_code == 0, got.output
    model = load_exported(tmp_path / "bare")
    ids = generate(model, tok.encode("the cat"), max_new_tokens=5, temperature=0.0, eos=tok.EOS)
    assert got.output.splitlines()[-1] == ("the cat" + tok.decode(ids)).splitlines()[-1]
    # The export directory's own tokenizer.json is found without the option.
    tok.save(tmp_path / "bare" / TOKENIZER_FILE)
    assert runner.invoke(app, [*args, "--temperature", "0"]).output == got.output
    small = train_bpe((f"x{i} y{i}" for i in range(100)), vocab_size=280)
    big_cfg = ModelConfig(d_model=32, n_heads=2, seq_len=16, n_layers=1, vocab_size=small.vocab_size - 1)
    save_export(tmp_path / "small", big_cfg, init_state(big_cfg, seed=0))
    small.save(tmp_path / "small" / TOKENIZER_FILE)
    too_big = runner.invoke(app, ["generate", "--from", str(tmp_path / "small"), "--prompt", "x"])
    assert too_big.exit_code != 0 and "the model only" in too_big.output
