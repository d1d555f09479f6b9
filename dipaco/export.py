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
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.console import Console
from safetensors.torch import load_file, save_file

from coordinator.cli_options import CaFileOpt
from coordinator.client import ClientError, CoordinatorClient
from dipaco.commands import connect, require_token
from dipaco.evaluation import EvalError, fetch_run_paths, load_router
from modules import ModelConfig, PathModel, compose_state
from router.router import RouterError
from router.tokenizer import ByteTokenizer
from router.user_errors import user_errors

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


class ExportError(RuntimeError):
    """A path cannot be exported, or an export directory cannot be loaded."""


def path_state(
    client: CoordinatorClient, *, run_id: int, path_index: int
) -> tuple[ModelConfig, dict[str, Any], dict[str, torch.Tensor]]:
    """(model config, provenance, state dict) of one path at the modules' current versions, from the coordinator."""
    run_paths = fetch_run_paths(client, run_id)
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
    """Write `model.safetensors` then `config.json` (each via a temporary file and rename)."""
    PathModel(cfg).load_state_dict(state, strict=True)  # refuse an export that would not load
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_FILE).unlink(missing_ok=True)
    tmp = out_dir / f".{WEIGHTS_FILE}.tmp-{os.getpid()}"
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
    save_file(tensors, str(tmp), metadata={"dipaco": json.dumps(provenance or {}, sort_keys=True)})
    os.replace(tmp, out_dir / WEIGHTS_FILE)
    tmp = out_dir / f".{CONFIG_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out_dir / CONFIG_FILE)
    return out_dir


def export_path(client: CoordinatorClient, *, run_id: int, path_index: int, out_dir: Path) -> dict[str, Any]:
    """Export one path of a run; returns its provenance."""
    cfg, provenance, state = path_state(client, run_id=run_id, path_index=path_index)
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
) -> list[int]:
    """Sample up to `max_new_tokens` tokens after `prompt` (only the new tokens are returned); the context is the
    last `seq_len` tokens. temperature 0: greedy. Stops after EOS when `stop_at_eos`.

    Every step re-reads the whole window, so positions count from 0 at the window's first token, learned (gpt2)
    or rotary (llama) alike: as in training, where every sequence is a seq_len window cut anywhere in a shard."""
    if temperature < 0 or max_new_tokens < 0:
        raise ValueError(f"temperature and max_new_tokens must be >= 0, got {temperature}, {max_new_tokens}")
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt) or [ByteTokenizer.EOS]  # an empty prompt starts as if after a document boundary
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
        if stop_at_eos and nxt == ByteTokenizer.EOS:
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
    return user_errors(console, ExportError, EvalError, RouterError, ClientError, ValueError)


def export_command(
    ctx: typer.Context,
    coordinator: Annotated[str, typer.Option(help="Coordinator base URL, e.g. http://127.0.0.1:8000.")],
    run: Annotated[int, typer.Option(help="Run id.")],
    path: Annotated[int, typer.Option(min=0, help="Path index to export.")],
    out: Annotated[Path, typer.Option(help="Output directory (model.safetensors + config.json).")],
    token: Annotated[str, typer.Option(envvar="DIPACO_TOKEN", help="Admin token (needed to read weights).")] = "",
    ca_file: CaFileOpt = None,
) -> None:
    """Export one path of a run (current module versions) as a standalone safetensors file + config.json."""
    console = Console()
    token = require_token(console, token)
    with _user_errors(console), connect(ctx, coordinator, token, ca_file) as client:
        provenance = export_path(client, run_id=run, path_index=path, out_dir=out)
    versions = ", ".join(f"{m['level']}[{m['index']}]@v{m['version']}" for m in provenance["modules"])
    console.print(f"exported run {run} path {path} (round {provenance['round']}; {versions}) to {out}")


def generate_command(
    ctx: typer.Context,
    prompt: Annotated[str, typer.Option(help="Text to continue.")] = "",
    source: Annotated[Path | None, typer.Option("--from", help="An export directory (from `dipaco export`).")] = None,
    coordinator: Annotated[str | None, typer.Option(help="Coordinator URL (with --run and --router).")] = None,
    run: Annotated[int | None, typer.Option(help="Run id: the prompt's prefix picks the path.")] = None,
    router: Annotated[
        Path | None, typer.Option(help="Router directory, or the shard directory holding router/.")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(min=0, help="Tokens (bytes) to sample.")] = 200,
    temperature: Annotated[float, typer.Option(min=0.0, help="0: greedy.")] = 0.8,
    seed: Annotated[int, typer.Option(help="Sampling seed: the same seed gives the same text.")] = 0,
    token: Annotated[str, typer.Option(envvar="DIPACO_TOKEN", help="Admin token (needed to read weights).")] = "",
    ca_file: CaFileOpt = None,
) -> None:
    """Sample text from an exported path (--from DIR) or from a run with routing (--coordinator, --run, --router)."""
    console = Console()
    tok = ByteTokenizer()
    with _user_errors(console):
        if source is not None:
            if coordinator or run is not None or router:
                raise ExportError("use either --from or --coordinator/--run/--router, not both")
            model, where = load_exported(source), f"export {source}"
        else:
            if not (coordinator and run is not None and router):
                raise ExportError("give --from DIR, or all of --coordinator, --run and --router")
            with connect(ctx, coordinator, require_token(console, token), ca_file) as client:
                model, path = routed_model(client, run_id=run, router_dir=router, prompt=prompt)
            where = f"run {run}, path {path} (routed by the prompt's first 32 tokens)"
        ids = generate(model, tok.encode(prompt), max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    console.print(f"[dim]{where}[/dim]", highlight=False)
    typer.echo(prompt + tok.decode(ids))
