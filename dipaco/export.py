"""`dipaco export` and `dipaco generate`: one path as a standalone model, and sampling text from it.

An export is a directory with two files:

* `model.safetensors`: the path's state dict (the `modules.PathModel` parameter names), its header metadata
  recording run, path, layout and module versions (provenance only; loading does not need it);
* `config.json`: the `modules.ModelConfig` fields (the block style `gpt2` or `llama` and `tie_embeddings` among
  them: a tied export has no `lm_head.weight`), written last (complete-or-absent). A config.json without `block`
  was written before blocks were selectable and loads as gpt2.

`load_exported(dir)` gives a plain `PathModel` in eval mode, without the coordinator. `generate` samples from
any `PathModel`: temperature 0 is greedy; otherwise a `torch.Generator` seeded with `seed` drives
`torch.multinomial`, so the same seed gives the same text (on the same machine and torch build). With a run and
a router (`dipaco generate --coordinator ... --run ... --router ...`) the prompt's first 32 tokens pick the
path, as at training and evaluation time (DiPaCo §2.4).

Tokens: a path trained on BPE shards reads and writes BPE ids. `dipaco generate` encodes the prompt and decodes
the sample with the `tokenizer.json` saved with the shards: found with `--router` (as `dipaco eval` does), in the
export directory, or named with `--tokenizer`; a model whose vocabulary is larger than bytes is refused without
one. EOS (the token that ends a document, where sampling stops) is the tokenizer's.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.console import Console
from safetensors.torch import load_file, save_file

from coordinator.cli_options import CaFileOpt, ReadTokenOpt, console, resolve_token
from coordinator.client import ClientError, CoordinatorClient
from dipaco.commands import connect
from dipaco.evaluation import EvalError, fetch_run_paths, find_tokenizer, load_router
from dipaco.progress import Progress
from modules import ModelConfig, PathModel, compose_state
from router.bpe import TOKENIZER_FILE, BPEError, BPETokenizer
from router.router import RouterError
from router.tokenizer import ByteTokenizer
from router.user_errors import user_errors

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


class ExportError(RuntimeError):
    """A path cannot be exported, or an export directory cannot be loaded."""


def path_state(
    client: CoordinatorClient, *, run_id: int, path_index: int, progress: Progress | None = None
) -> tuple[ModelConfig, dict[str, Any], dict[str, torch.Tensor]]:
    """(model config, provenance, state dict) of one path at the modules' current versions, from the coordinator
    (`progress`: told about each module fetched)."""
    run_paths = fetch_run_paths(client, run_id, on_fetch=progress.fetched if progress is not None else None)
    if not 0 <= path_index < run_paths.num_paths:
        raise ExportError(f"run {run_id} has {run_paths.num_paths} path(s); path {path_index} does not exist")
    modules = run_paths.modules[path_index]
    state = compose_state([run_paths.weights(m) for m in modules])
    provenance = {
        "run_id": run_id,
        "run_name": run_paths.run.name,
        "path_index": path_index,
        "layout": run_paths.run.layout,
        "round": run_paths.run.current_round,
        "modules": [
            {"id": m.id, "level": m.level_name, "index": m.index, "version": m.version, "sha256": m.weights_hash}
            for m in modules
        ],
    }
    return run_paths.config, provenance, state


def save_export(
    out_dir: Path, cfg: ModelConfig, state: dict[str, torch.Tensor], provenance: dict[str, Any] | None = None
) -> Path:
    """Write `model.safetensors` then `config.json` (each via a temporary file and rename), both with the mode an
    ordinary new file gets here (the umask's), whatever mode the safetensors writer gave its file."""
    PathModel(cfg).load_state_dict(state, strict=True)  # refuse an export that would not load
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_FILE).unlink(missing_ok=True)
    weights_tmp = out_dir / f".{WEIGHTS_FILE}.tmp-{os.getpid()}"
    config_tmp = out_dir / f".{CONFIG_FILE}.tmp-{os.getpid()}"
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
    save_file(tensors, str(weights_tmp), metadata={"dipaco": json.dumps(provenance or {}, sort_keys=True)})
    config_tmp.write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n")
    weights_tmp.chmod(stat.S_IMODE(config_tmp.stat().st_mode))
    os.replace(weights_tmp, out_dir / WEIGHTS_FILE)
    os.replace(config_tmp, out_dir / CONFIG_FILE)
    return out_dir


def export_path(
    client: CoordinatorClient, *, run_id: int, path_index: int, out_dir: Path, progress: Progress | None = None
) -> dict[str, Any]:
    """Export one path of a run; returns its provenance."""
    cfg, provenance, state = path_state(client, run_id=run_id, path_index=path_index, progress=progress)
    save_export(out_dir, cfg, state, provenance)
    return provenance


def load_exported(directory: Path) -> PathModel:
    """The exported path as a plain `PathModel` (eval mode, CPU); needs nothing but the two files."""
    config, weights = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config.is_file() or not weights.is_file():
        raise ExportError(f"no export in {directory} (need {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        cfg = ModelConfig.from_dict(json.loads(config.read_text()))
        model = PathModel(cfg)
        model.load_state_dict(load_file(str(weights)), strict=True)
    except (ValueError, RuntimeError, TypeError) as exc:
        raise ExportError(f"{directory}: cannot load the export: {exc}") from exc
    return model.eval()


@torch.no_grad()
def generate(
    model: PathModel,
    prompt: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    stop_at_eos: bool = True,
    eos: int = ByteTokenizer.EOS,
) -> list[int]:
    """Sample up to `max_new_tokens` tokens after `prompt` (only the new tokens are returned); the context is the
    last `seq_len` tokens. temperature 0: greedy. Stops after `eos` (the tokenizer's end of document) when
    `stop_at_eos`.

    Every step re-reads the whole window, so positions count from 0 at the window's first token, learned (gpt2)
    or rotary (llama) alike: as in training, where every sequence is a seq_len window cut anywhere in a shard."""
    if temperature < 0 or max_new_tokens < 0:
        raise ValueError(f"temperature and max_new_tokens must be >= 0, got {temperature}, {max_new_tokens}")
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt) or [eos]  # an empty prompt starts as if after a document boundary
    out: list[int] = []
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-model.cfg.seq_len :]], dtype=torch.long, device=device)
        logits = model(window)[0, -1].float().cpu()
        if temperature == 0:
            nxt = int(torch.argmax(logits))
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=gen))
        ids.append(nxt)
        out.append(nxt)
        if stop_at_eos and nxt == eos:
            break
    return out


def routed_model(client: CoordinatorClient, *, run_id: int, router_dir: Path, prompt: str) -> tuple[PathModel, int]:
    """The run's path that the prompt's prefix routes to, built from the current module versions."""
    router = load_router(router_dir)
    run_paths = fetch_run_paths(client, run_id)
    if router.num_paths != run_paths.num_paths:
        raise ExportError(f"the router has {router.num_paths} paths, run {run_id} has {run_paths.num_paths}")
    path = int(router.route([prompt])[0])
    return run_paths.build(path).eval(), path


# ----------------------------------------------------------------------------------------------------- CLI


def _user_errors(console: Console) -> contextlib.AbstractContextManager[None]:
    return user_errors(console, ExportError, EvalError, RouterError, ClientError, BPEError, ValueError)


def export_command(
    ctx: typer.Context,
    coordinator: Annotated[str, typer.Option(help="Coordinator base URL, e.g. http://127.0.0.1:8000.")],
    run: Annotated[int, typer.Option(help="Run id.")],
    path: Annotated[int, typer.Option(min=0, help="Path index to export.")],
    out: Annotated[Path, typer.Option(help="Output directory (model.safetensors + config.json).")],
    token: ReadTokenOpt = "",
    ca_file: CaFileOpt = None,
) -> None:
    """Export one path of a run (current module versions) as a standalone safetensors file + config.json."""
    out_console = console()
    token = resolve_token(token)
    progress = Progress("export")
    progress.update(f"fetching the modules of run {run} path {path}", force=True)
    with _user_errors(out_console), connect(ctx, coordinator, token, ca_file) as client:
        provenance = export_path(client, run_id=run, path_index=path, out_dir=out, progress=progress)
    versions = ", ".join(f"{m['level']}[{m['index']}]@v{m['version']}" for m in provenance["modules"])
    out_console.print(
        f"exported run {run} path {path} (round {provenance['round']}; {versions}) to {out}", highlight=False
    )


def generate_command(
    ctx: typer.Context,
    prompt: Annotated[str, typer.Option(help="Text to continue.")] = "",
    source: Annotated[Path | None, typer.Option("--from", help="An export directory (from `dipaco export`).")] = None,
    coordinator: Annotated[str | None, typer.Option(help="Coordinator URL (with --run and --router).")] = None,
    run: Annotated[int | None, typer.Option(help="Run id: the prompt's prefix picks the path.")] = None,
    router: Annotated[
        Path | None, typer.Option(help="Router directory, or the shard directory holding router/.")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(min=0, help="Tokens to sample (bytes, or BPE tokens).")] = 200,
    temperature: Annotated[float, typer.Option(min=0.0, help="0: greedy.")] = 0.8,
    seed: Annotated[int, typer.Option(help="Sampling seed: the same seed gives the same text.")] = 0,
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            help="The BPE tokenizer.json the model was trained with, or the shard directory holding it (default: "
            "found with --router or in the export directory; none: bytes)."
        ),
    ] = None,
    token: ReadTokenOpt = "",
    ca_file: CaFileOpt = None,
) -> None:
    """Sample text from an exported path (--from DIR) or from a run with routing (--coordinator, --run, --router)."""
    out = console()
    with _user_errors(out):
        if source is not None:
            if coordinator or run is not None or router:
                raise ExportError("use either --from or --coordinator/--run/--router, not both")
            model, where = load_exported(source), f"export {source}"
        else:
            if not (coordinator and run is not None and router):
                raise ExportError("give --from DIR, or all of --coordinator, --run and --router")
            with connect(ctx, coordinator, resolve_token(token), ca_file) as client:
                model, path = routed_model(client, run_id=run, router_dir=router, prompt=prompt)
            where = f"run {run}, path {path} (routed by the prompt's first 32 tokens)"
        tok = model_tokenizer(model.cfg, tokenizer or source or router)
        ids = generate(
            model, tok.encode(prompt), max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, eos=tok.EOS
        )
    out.print(f"[dim]{where}[/dim]", highlight=False)
    typer.echo(prompt + tok.decode(ids))


def model_tokenizer(cfg: ModelConfig, where: Path | None) -> ByteTokenizer | BPETokenizer:
    """The tokenizer of a model: the BPE `tokenizer.json` at or in `where` (a file, an export or shard directory,
    a router directory next to one), else bytes; refused when it does not fit the model's vocabulary."""
    found = find_tokenizer(where) if where is not None else None
    if found is not None:
        if found.vocab_size > cfg.vocab_size:
            raise ExportError(f"the tokenizer has {found.vocab_size} tokens, the model only {cfg.vocab_size}")
        return found
    if cfg.vocab_size > ByteTokenizer.vocab_size:
        raise ExportError(
            f"the model has {cfg.vocab_size} tokens, so it was trained on BPE shards: pass --tokenizer with their "
            f"{TOKENIZER_FILE} (or the shard directory)"
        )
    return ByteTokenizer()
