"""Quality driver: train layouts through the real service and measure held-out routed perplexity per round
(ARCHITECTURE §10; DiPaCo arXiv 2403.10616 Tab. 1, §2.5, §2.7).

For each contender (a layout + model size) the driver creates a run on a real coordinator (`LocalService`:
subprocess on SQLite + blob dir), registers shards of the corpus (the built-in one, the multilingual man pages,
or any corpus directory) routed for that layout's number of paths, starts one island subprocess per path
(capped), waits for the run to finish, then fetches every module at every version over REST
(`GET /v1/modules/{id}/weights?version=v`: version v is the module after round v-1, version 0 the
initialisation) and scores the held-out split with `router.evaluate.evaluate_routed`: each document routed by its
first 32 tokens, the prefix never scored, for every model (dense ones too).

Tokens. With `QualitySettings(tokenizer="bpe")` one byte-level BPE is trained on the train split
(`corpus_tokenizer`, cached in the work directory) and every shard directory is cut with it, so all contenders
share one vocabulary; the contenders' models get its `vocab_size` (`standard_contenders(vocab_size=...)`), and
every evaluation encodes with the tokenizer saved with the shards.

Why one island per path: an island keeps its AdamW state only while it trains the same path again
(island/worker.py); with fewer islands than paths every lease restarts AdamW from zero, which the in-process
simulator (and DiLoCo) never does. One island per path keeps the service on the simulator's trajectory.

Held-out halves. The held-out documents are split (stable hash of the text) into a validation and a test half,
and every round is scored on both (the same cost as scoring all of them once). The headline number is the
perplexity over both halves; per-path early stopping (§2.7) picks, for every path, the round with the lowest
validation loss and reports the test half, next to the final round on the same test half.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from coordinator.client import CoordinatorClient
from coordinator.schemas import RunCreate
from dipaco.evaluation import fetch_run_paths, find_tokenizer, load_documents
from dipaco.router_commands import register_shards
from dipaco.service import LocalService
from modules import (
    InnerConfig,
    ModelConfig,
    OuterConfig,
    build_path,
    decode,
    flavour,
    parse_layout,
    simulate,
)
from modules.codec import GradCodec
from modules.layout import Layout
from router.bpe import BPETokenizer, train_bpe
from router.corpus import MANIFEST_FILE, TRAIN_FILE, CorpusError, build_local_corpus, iter_jsonl, load_corpus_manifest
from router.evaluate import EvalResult, SinglePathRouter, evaluate_routed
from router.manpages import build_manpages_corpus
from router.router import Router
from router.shards import ORDER_KEY, ROUTER_DIR, TOKENIZERS, ShardOptions, load_manifest, shard_corpus

Tensors = dict[str, torch.Tensor]
Log = Callable[[str], None]
HALVES = ("val", "test")


@dataclass(kw_only=True, slots=True)
class Contender:
    """One model of the comparison: a layout over a model config."""

    name: str
    model: dict[str, Any]
    """`RunCreate.model`: flavour plus overrides (e.g. a doubled d_model)."""
    layout: str
    """Layout string (see `modules.layout`)."""
    levels: tuple[int, ...] = ()
    """Routed levels (K per level); () for a dense model. Their product is the number of paths."""
    token_factor: int = 1
    """Inner steps per round x this: a reference that sees as many tokens as all paths of a modular model."""

    @property
    def num_paths(self) -> int:
        return math.prod(self.levels) if self.levels else 1

    def config(self) -> ModelConfig:
        cfg = flavour(self.model.get("flavour", "debug"))
        overrides = {k: v for k, v in self.model.items() if k != "flavour"}
        return ModelConfig.from_dict({**cfg.to_dict(), **overrides})

    def parsed_layout(self) -> Layout:
        return parse_layout(self.layout, n_layers=self.config().n_layers)

    def path_params(self) -> int:
        return _count(self.config())

    def total_params(self) -> int:
        """Distinct parameters of the whole modular model (each module counted once)."""
        cfg, layout = self.config(), self.parsed_layout()
        sizes = _level_sizes(cfg, layout)
        return sum(size * layout.num_modules(i) for i, size in enumerate(sizes))


def _count(cfg: ModelConfig) -> int:
    from modules.model import PathModel

    return sum(p.numel() for p in PathModel(cfg).parameters())


def _level_sizes(cfg: ModelConfig, layout: Layout) -> list[int]:
    from modules.model import PathModel

    sizes = [0] * len(layout.levels)
    for name, t in PathModel(cfg).state_dict().items():
        sizes[layout.level_of(name)] += t.numel()
    return sizes


def dense_layout(n_layers: int) -> str:
    return f"embed:shared, b0-{n_layers - 1}:shared, head:shared"


def standard_contenders(
    flavour_name: str = "debug",
    *,
    block: str | None = None,
    width_factor: int = 2,
    with_4x4: bool = False,
    with_token_reference: bool = False,
    vocab_size: int | None = None,
) -> list[Contender]:
    """dense-S (one path of size S), DiPaCo 2x2, flat 4 experts, dense with ~4x S params (d_model x width_factor);
    optionally DiPaCo 4x4. The blocks are split evenly between the two routed levels of a grid. `block`: the
    transformer block style of every contender (gpt2, llama; None: the flavour's). `vocab_size`: the model
    vocabulary, e.g. a BPE tokenizer's (None: the flavour's byte vocabulary)."""
    cfg = flavour(flavour_name)
    n = cfg.n_layers
    half = n // 2
    grid = f"embed:shared, b0-{half - 1}:routed{{k}}, b{half}-{n - 1}:routed{{k}}, head:shared"
    base: dict[str, Any] = (
        {"flavour": flavour_name}
        | ({"block": block} if block else {})
        | ({"vocab_size": vocab_size} if vocab_size is not None else {})
    )
    out = [
        Contender(name="dense-S", model=base, layout=dense_layout(n)),
        Contender(name="DiPaCo 2x2", model=base, layout=grid.format(k=2), levels=(2, 2)),
        Contender(name="flat 4", model=base, layout=f"embed:shared, b0-{n - 1}:routed4, head:shared", levels=(4,)),
        Contender(
            name=f"dense-{width_factor}w", model={**base, "d_model": cfg.d_model * width_factor}, layout=dense_layout(n)
        ),
    ]
    if with_4x4:
        out.append(Contender(name="DiPaCo 4x4", model=base, layout=grid.format(k=4), levels=(4, 4)))
    if with_token_reference:
        # for reference: the wide dense model on as many tokens as the 4 paths of the 2x2 see together
        wide = {**base, "d_model": cfg.d_model * width_factor}
        name = f"dense-{width_factor}w 4x tokens"
        out.append(Contender(name=name, model=wide, layout=dense_layout(n), token_factor=4))
    return out


@dataclass(kw_only=True, slots=True)
class QualitySettings:
    """Training and evaluation settings shared by every contender (same steps per path for all)."""

    rounds: int = 5
    inner_steps: int = 30
    """H: inner AdamW steps per round."""
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 10
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    seed: int = 0
    routing: str = "flat"
    """`flat`: one k-means over all paths (best purity on the local corpus); `product`: product k-means with one
    k-means per routed level (paper App. 7.3; purity 0.41 vs 0.72 at 4 paths, see docs/ROUTER.md)."""
    max_islands: int = 4
    """Island subprocesses per run: min(paths, this). Fewer islands than paths resets AdamW (module doc)."""
    eval_every: int = 1
    """Score every this-many rounds (plus round 0 and the last)."""
    eval_docs: int | None = None
    """Held-out documents scored (stable-hash subsample); None: all."""
    eval_threads: int = 1
    """torch threads while scoring: on 2 busy cores one thread was 2.5x faster than two (docs/LOG.md)."""
    reroute_every: int | None = None
    """Also score the last round re-routing every W tokens (paper §2.5)."""
    codec: GradCodec = "int8"
    """How the islands upload their outer gradients (the run field `codec`: fp32, bf16, int8)."""
    tokenizer: str = "byte"
    """Shard tokens: `byte`, or `bpe` (one tokenizer of `vocab_size` trained on the train split, shared by every
    contender; see the module doc)."""
    vocab_size: int = 8192
    """BPE vocabulary (with `tokenizer="bpe"`)."""
    shuffle: bool = True
    """Shards in a seeded random document order (`ShardOptions.shuffle`); False reproduces corpus-order shards."""

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.inner_steps < 1 or self.batch_size < 1 or self.eval_every < 1:
            raise ValueError("rounds, inner_steps, batch_size and eval_every must be >= 1")
        if self.routing not in ("flat", "product"):
            raise ValueError(f"routing must be 'flat' or 'product', got {self.routing!r}")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {', '.join(TOKENIZERS)}, got {self.tokenizer!r}")

    def eval_rounds(self) -> list[int]:
        """Module versions scored: 0 (initialisation), every `eval_every`, and the last."""
        return sorted({0, self.rounds, *range(0, self.rounds + 1, self.eval_every)})


@dataclass(kw_only=True, slots=True)
class ModelResult:
    """What one contender got; `halves[i][h][p]` = (nll sum, tokens) of path p on half h at `rounds[i]`."""

    name: str
    layout: str
    num_paths: int
    path_params: int
    total_params: int
    steps_per_path: int
    tokens_per_path: int
    rounds: list[int]
    halves: list[dict[str, list[tuple[float, int]]]]
    train_loss: list[float] = field(default_factory=list)
    """Mean over paths of the inner train loss, per round (from the contributions)."""
    run_id: int | None = None
    purity: float | None = None
    reroute_ppl: float | None = None
    island_switches: int = 0
    """AdamW restarts caused by a path changing island between rounds (0 = the simulator's trajectory)."""
    train_s: float = 0.0
    eval_s: float = 0.0

    def ppl(self, i: int, halves: Sequence[str] = HALVES) -> float:
        nll = sum(n for h in halves for n, _ in self.halves[i][h])
        tok = sum(t for h in halves for _, t in self.halves[i][h])
        return math.exp(nll / tok) if tok else math.nan

    @property
    def ppl_per_round(self) -> list[float]:
        return [self.ppl(i) for i in range(len(self.rounds))]

    @property
    def final_ppl(self) -> float:
        return self.ppl(len(self.rounds) - 1)

    @property
    def final_test_ppl(self) -> float:
        return self.ppl(len(self.rounds) - 1, ("test",))

    @property
    def early_stopped_test_ppl(self) -> float:
        """Per-path early stopping (§2.7): each path at its round of lowest validation loss, scored on test."""
        nll = tok = 0.0
        for p in range(self.num_paths):

            def val_loss(i: int, p: int = p) -> float:
                n, t = self.halves[i]["val"][p]
                return n / t if t else math.inf

            best = (
                min(range(len(self.rounds)), key=val_loss)
                if any(self.halves[i]["val"][p][1] for i in range(len(self.rounds)))
                else len(self.rounds) - 1
            )
            n, t = self.halves[best]["test"][p]
            nll, tok = nll + n, tok + t
        return math.exp(nll / tok) if tok else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "layout": self.layout,
            "num_paths": self.num_paths,
            "path_params": self.path_params,
            "total_params": self.total_params,
            "steps_per_path": self.steps_per_path,
            "tokens_per_path": self.tokens_per_path,
            "rounds": self.rounds,
            "ppl_per_round": self.ppl_per_round,
            "final_ppl": self.final_ppl,
            "final_test_ppl": self.final_test_ppl,
            "early_stopped_test_ppl": self.early_stopped_test_ppl,
            "train_loss": self.train_loss,
            "run_id": self.run_id,
            "purity": self.purity,
            "reroute_ppl": self.reroute_ppl,
            "island_switches": self.island_switches,
            "train_s": round(self.train_s, 1),
            "eval_s": round(self.eval_s, 1),
        }


# ---------------------------------------------------------------------------------------------------- data


def split_heldout(documents: Sequence[str], *, max_docs: int | None = None) -> dict[str, list[str]]:
    """Validation and test halves by a stable hash of the text; optionally a stable subsample first."""
    keyed = sorted(documents, key=lambda d: hashlib.sha256(d.encode("utf-8", "replace")).hexdigest())
    if max_docs is not None:
        keyed = keyed[:max_docs]
    return {"val": keyed[0::2], "test": keyed[1::2]}


BUILTIN_CORPORA = ("local", "manpages")


def prepare_corpus(corpus_dir: Path, *, docs_per_domain: int = 400, builtin: str = "local") -> dict[str, Any]:
    """A built-in corpus in `corpus_dir`, reused when the one there was built with the same parameters: `local`
    (`router.build_local_corpus`, `docs_per_domain` per domain) or `manpages` (`router.manpages`: the translated
    manual pages, multilingual, in source order)."""
    if builtin not in BUILTIN_CORPORA:
        raise CorpusError(f"unknown built-in corpus {builtin!r}; use one of {', '.join(BUILTIN_CORPORA)}")
    if (corpus_dir / MANIFEST_FILE).is_file():
        manifest = dict(load_corpus_manifest(corpus_dir))
        if builtin == "manpages" and "manpages" in manifest:
            return manifest
        if builtin == "local" and manifest.get("parameters", {}).get("max_docs_per_domain") == docs_per_domain:
            return manifest
    if builtin == "manpages":
        return build_manpages_corpus(corpus_dir)
    return build_local_corpus(corpus_dir, max_docs_per_domain=docs_per_domain)


def corpus_tokenizer(corpus_dir: Path, root: Path, settings: QualitySettings) -> BPETokenizer | None:
    """The one BPE tokenizer of a comparison (None for byte tokens): trained on the train split once and cached
    in `root` under the corpus manifest's hash, so every shard directory (and a later run) cuts the same tokens."""
    if settings.tokenizer != "bpe":
        return None
    digest = hashlib.sha256((corpus_dir / MANIFEST_FILE).read_bytes()).hexdigest()[:16]
    path = root / f"tokenizer-bpe{settings.vocab_size}-{digest}.json"
    if path.is_file():
        return BPETokenizer.load(path)
    tok = train_bpe((str(d["text"]) for d in iter_jsonl(corpus_dir / TRAIN_FILE)), vocab_size=settings.vocab_size)
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tok.save(tmp)
    tmp.replace(path)
    return tok


def shards_for(corpus_dir: Path, root: Path, levels: tuple[int, ...], settings: QualitySettings) -> Path:
    """Shard directory for a number of paths (built once, reused while its manifest matches the settings): flat
    k-means, or product k-means per level; shuffled unless `settings.shuffle` is off; BPE with the comparison's
    one tokenizer (`corpus_tokenizer`)."""
    num_paths = math.prod(levels) if levels else 1
    product = settings.routing == "product" and len(levels) >= 2
    name = f"shards-{'x'.join(map(str, levels))}-product" if product else f"shards-{num_paths}"
    name += f"-bpe{settings.vocab_size}" if settings.tokenizer == "bpe" else ""
    name += "" if settings.shuffle else "-corpus-order"
    out = root / name
    tok = corpus_tokenizer(corpus_dir, root, settings)
    if (out / "manifest.json").is_file():
        manifest = load_manifest(out)
        order = {"shuffled": True, "seed": settings.seed, "key": ORDER_KEY} if settings.shuffle else {"shuffled": False}
        corpus_sha256 = hashlib.sha256((corpus_dir / MANIFEST_FILE).read_bytes()).hexdigest()
        if manifest["corpus_manifest_sha256"] == corpus_sha256 and manifest.get("order") == order:
            return out
    options = ShardOptions(
        num_paths=num_paths, seed=settings.seed, levels=list(levels) if product else None, shuffle=settings.shuffle
    )
    shard_corpus(corpus_dir, out, options, tokenizer=tok)
    return out


def shard_tokens(shards_dir: Path) -> list[torch.Tensor]:
    manifest = load_manifest(shards_dir)
    return [
        torch.from_numpy(np.fromfile(shards_dir / s["file"], dtype="<u2").astype(np.int64))
        for s in sorted(manifest["shards"], key=lambda s: s["path_index"])
    ]


# ------------------------------------------------------------------------------------------------ training


def run_spec(contender: Contender, settings: QualitySettings, *, name: str) -> RunCreate:
    """The run of one contender (what is not set here takes the coordinator's defaults)."""
    spec = {
        "name": name,
        "model": contender.model,
        "layout": contender.layout,
        "inner": {
            "batch_size": settings.batch_size,
            "lr": settings.lr,
            "warmup_steps": min(settings.warmup_steps, settings.inner_steps * settings.rounds),
        },
        # (warmup stays the same number of steps for a token_factor reference)
        "outer": {"lr": settings.outer_lr, "momentum": settings.outer_momentum},
        "inner_steps": settings.inner_steps * contender.token_factor,
        "num_rounds": settings.rounds,
        "seed": settings.seed,
        "lease_ttl_s": 120,
        "codec": settings.codec,
    }
    return RunCreate.model_validate(spec)


def train_losses(client: CoordinatorClient, run_id: int) -> dict[int, dict[int, float]]:
    """{round: {path: mean inner train loss}} from the run's contributions."""
    out: dict[int, dict[int, float]] = {}
    for c in client.contributions(run_id=run_id):
        out.setdefault(c.round, {})[c.path_index] = c.train_loss
    return out


def island_switches(client: CoordinatorClient, run_id: int) -> int:
    """Rounds in which a path was trained by another island than in the round before: each one restarted that
    path's AdamW state (island/worker.py keeps it only for the path it trained last)."""
    by_path: dict[int, list[tuple[int, int]]] = {}
    for c in client.contributions(run_id=run_id):
        by_path.setdefault(c.path_index, []).append((c.round, c.island_id))
    switches = 0
    for rows in by_path.values():
        islands = [island for _, island in sorted(rows)]
        switches += sum(a != b for a, b in zip(islands, islands[1:], strict=False))
    return switches


def train_contender(
    service: LocalService,
    contender: Contender,
    shards_dir: Path,
    settings: QualitySettings,
    *,
    workdir: Path,
    tag: str,
    log: Log = lambda s: None,
) -> int:
    """Create the run, register its shards, run one island per path (capped) until it finishes; the run id."""
    run = service.create_run(run_spec(contender, settings, name=tag))
    islands = min(contender.num_paths, settings.max_islands)
    log(f"    {contender.name}: run {run.id}, {run.num_paths} path(s), {islands} island(s)")
    names = service.start_islands(islands, prefix=f"{tag}-island", cache_root=workdir / "islands")
    try:
        # Shards last: the run starts leasing only once every island has joined, so that in round 0 each island
        # takes one path (and keeps it: the coordinator prefers the path an island trained last).
        service.wait_islands_joined(names)
        register_shards(shards_dir, client=service.client, run_id=run.id)
        service.wait_finished(run.id)
    except BaseException:
        service.stop_islands(wait_s=0)
        raise
    service.stop_islands()
    return run.id


# ---------------------------------------------------------------------------------------------- evaluation


class VersionedWeights:
    """Module weights at any version, checked against the content hash the coordinator sends with them (the
    registry lists the hash of the current version only)."""

    def __init__(self, client: CoordinatorClient) -> None:
        self.client = client
        self._cache: dict[tuple[int, int], Tensors] = {}

    def get(self, module_id: int, version: int) -> Tensors:
        key = (module_id, version)
        if key not in self._cache:
            self._cache[key] = decode(self.client.module_weights(module_id, version))
        return self._cache[key]

    def forget_before(self, version: int) -> None:
        self._cache = {k: v for k, v in self._cache.items() if k[1] >= version}


def _score(
    paths: Callable[[int], nn.Module],
    router: Router | SinglePathRouter,
    docs: list[str],
    *,
    context: int,
    every: int | None = None,
    tokenizer: BPETokenizer | None = None,
) -> EvalResult:
    return evaluate_routed(
        paths, router, docs, prefix_tokens=router.prefix_tokens, context=context, every=every, tokenizer=tokenizer
    )


def _per_path(result: EvalResult) -> list[tuple[float, int]]:
    return [((p.loss or 0.0) * p.num_tokens, p.num_tokens) for p in result.per_path]


def evaluate_run_rounds(
    client: CoordinatorClient,
    run_id: int,
    *,
    router: Router | SinglePathRouter,
    halves: dict[str, list[str]],
    rounds: Sequence[int],
    reroute_every: int | None = None,
    tokenizer: BPETokenizer | None = None,
) -> tuple[list[dict[str, list[tuple[float, int]]]], float | None]:
    """Score the run's paths at each module version in `rounds` on each held-out half; optionally the last
    version again with re-routing every W tokens (full held-out). `tokenizer`: the shards' BPE (None: bytes).
    Returns (per-round halves, re-routed ppl)."""
    run_paths = fetch_run_paths(client, run_id)
    weights = VersionedWeights(client)
    cfg = run_paths.config
    out: list[dict[str, list[tuple[float, int]]]] = []
    reroute: float | None = None
    for version in rounds:

        def build(p: int, version: int = version) -> nn.Module:
            return build_path(cfg, [weights.get(m.id, version) for m in run_paths.modules[p]])

        out.append(
            {
                h: _per_path(_score(build, router, docs, context=cfg.seq_len, tokenizer=tokenizer))
                for h, docs in halves.items()
            }
        )
        if version == rounds[-1] and reroute_every is not None and router.num_paths > 1:
            docs = [d for h in HALVES for d in halves[h]]
            reroute = _score(
                build, router, docs, context=cfg.seq_len, every=reroute_every, tokenizer=tokenizer
            ).perplexity
        weights.forget_before(version)
    return out, reroute


def evaluate_modules(
    cfg: ModelConfig,
    layout: Layout,
    modules: list[list[Tensors]],
    *,
    router: Router | SinglePathRouter,
    documents: list[str],
    tokenizer: BPETokenizer | None = None,
) -> EvalResult:
    """Routed held-out evaluation of in-memory modules (`modules[level][module]`, e.g. from the simulator)."""

    def build(p: int) -> nn.Module:
        return build_path(cfg, [modules[lv][m] for lv, m in enumerate(layout.path_modules(p))])

    return _score(build, router, documents, context=cfg.seq_len, tokenizer=tokenizer)


def router_for(contender: Contender, shards_dir: Path) -> Router | SinglePathRouter:
    return Router.load(shards_dir / ROUTER_DIR) if contender.num_paths > 1 else SinglePathRouter()


def shard_tokenizer(shards_dir: Path, contender: Contender) -> BPETokenizer | None:
    """The tokenizer saved with the shards (None: bytes), checked against the contender's model vocabulary."""
    tokenizer = find_tokenizer(shards_dir)
    vocab = tokenizer.vocab_size if tokenizer is not None else 257
    if vocab > contender.config().vocab_size:
        raise ValueError(
            f"{contender.name}: the shards in {shards_dir} have {vocab} token ids, the model only "
            f"{contender.config().vocab_size}; build the contenders with standard_contenders(vocab_size={vocab})"
        )
    return tokenizer


# --------------------------------------------------------------------------------------------- the driver


def measure(
    service: LocalService,
    contender: Contender,
    settings: QualitySettings,
    *,
    corpus_dir: Path,
    workdir: Path,
    halves: dict[str, list[str]],
    tag: str,
    run_id: int | None = None,
    log: Log = lambda s: None,
) -> ModelResult:
    """Train one contender through the service (unless `run_id` names a finished run of it) and score it."""
    shards_dir = shards_for(corpus_dir, workdir, contender.levels, settings)
    tokenizer = shard_tokenizer(shards_dir, contender)
    t0 = time.monotonic()
    if run_id is None:
        run_id = train_contender(service, contender, shards_dir, settings, workdir=workdir, tag=tag, log=log)
    train_s = time.monotonic() - t0
    router = router_for(contender, shards_dir)
    rounds = settings.eval_rounds()
    t1 = time.monotonic()
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.eval_threads)
    try:
        per_round, reroute = evaluate_run_rounds(
            service.client,
            run_id,
            router=router,
            halves=halves,
            rounds=rounds,
            reroute_every=settings.reroute_every,
            tokenizer=tokenizer,
        )
    finally:
        torch.set_num_threads(threads)
    losses = train_losses(service.client, run_id)
    cfg = contender.config()
    result = ModelResult(
        name=contender.name,
        layout=contender.layout,
        num_paths=contender.num_paths,
        path_params=contender.path_params(),
        total_params=contender.total_params(),
        steps_per_path=settings.rounds * settings.inner_steps * contender.token_factor,
        tokens_per_path=(
            settings.rounds * settings.inner_steps * contender.token_factor * settings.batch_size * cfg.seq_len
        ),
        rounds=rounds,
        halves=per_round,
        run_id=run_id,
        train_loss=[sum(row.values()) / len(row) for _, row in sorted(losses.items())],
        purity=load_manifest(shards_dir).get("purity") if contender.num_paths > 1 else None,
        reroute_ppl=reroute,
        island_switches=island_switches(service.client, run_id),
        train_s=train_s,
        eval_s=time.monotonic() - t1,
    )
    log(
        f"    {contender.name}: held-out ppl {result.ppl_per_round[0]:.2f} -> {result.final_ppl:.2f} "
        f"(train {train_s:.0f} s, eval {result.eval_s:.0f} s"
        + (f"; {result.island_switches} AdamW restart(s) from island switches" if result.island_switches else "")
        + ")"
    )
    return result


def run_comparison(
    service: LocalService,
    contenders: Sequence[Contender],
    settings: QualitySettings,
    *,
    corpus_dir: Path,
    workdir: Path,
    existing: dict[str, int] | None = None,
    log: Log = lambda s: None,
) -> list[ModelResult]:
    """Train (unless in `existing`: contender name -> finished run id) and score every contender."""
    documents = load_documents(corpus_dir, "heldout")
    halves = split_heldout(documents, max_docs=settings.eval_docs)
    results = []
    for i, contender in enumerate(contenders):
        tag = f"q{i}-{contender.name.replace(' ', '-')}-{time.strftime('%H%M%S')}"
        results.append(
            measure(
                service,
                contender,
                settings,
                corpus_dir=corpus_dir,
                workdir=workdir,
                halves=halves,
                tag=tag,
                run_id=(existing or {}).get(contender.name),
                log=log,
            )
        )
    return results


# -------------------------------------------------------------------------------------------- cross-check


@dataclass(kw_only=True, slots=True)
class CrossCheck:
    """The same contender through the service and through `modules.simulate`."""

    name: str
    service_ppl: float
    simulator_ppl: float
    service_train_loss: list[float]
    simulator_train_loss: list[float]
    tolerance: float

    @property
    def rel_diff(self) -> float:
        return abs(self.service_ppl - self.simulator_ppl) / self.simulator_ppl

    @property
    def max_train_loss_diff(self) -> float:
        return max(
            (abs(a - b) for a, b in zip(self.service_train_loss, self.simulator_train_loss, strict=True)), default=0.0
        )

    @property
    def ok(self) -> bool:
        return self.rel_diff <= self.tolerance


CROSS_CHECK_TOLERANCE = 0.01
"""Relative difference of final held-out perplexity allowed between service and simulator (see docs/QUALITY.md):
with one island per path both do the same float operations, so the difference is float summation order only
(one thread each; it grows over hundreds of AdamW steps but stays far below 1 %); seed-to-seed noise of the
perplexity at this scale is larger than 1 %, so 1 % is 'within noise'."""


def cross_check(
    result: ModelResult,
    contender: Contender,
    settings: QualitySettings,
    *,
    corpus_dir: Path,
    workdir: Path,
    documents: list[str] | None = None,
) -> CrossCheck:
    """Re-train `contender` with the in-process simulator on the same shards and settings (one torch thread, as
    the islands) and compare final held-out perplexity (both halves) and per-round train loss."""
    shards_dir = shards_for(corpus_dir, workdir, contender.levels, settings)
    tokenizer = shard_tokenizer(shards_dir, contender)
    cfg, layout = contender.config(), contender.parsed_layout()
    inner = InnerConfig(
        batch_size=settings.batch_size,
        lr=settings.lr,
        warmup_steps=min(settings.warmup_steps, settings.inner_steps * settings.rounds),
        total_steps=settings.rounds * settings.inner_steps,
    )
    outer = OuterConfig(lr=settings.outer_lr, momentum=settings.outer_momentum)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sim = simulate(
            cfg,
            layout,
            inner,
            outer,
            steps_per_round=settings.inner_steps,
            rounds=settings.rounds,
            seed=settings.seed,
            tokens=shard_tokens(shards_dir),
            codec=settings.codec,
        )
    finally:
        torch.set_num_threads(threads)
    if documents is None:
        halves = split_heldout(load_documents(corpus_dir, "heldout"), max_docs=settings.eval_docs)
        documents = [d for h in HALVES for d in halves[h]]
    ev = evaluate_modules(
        cfg, layout, sim.modules, router=router_for(contender, shards_dir), documents=documents, tokenizer=tokenizer
    )
    return CrossCheck(
        name=contender.name,
        service_ppl=result.final_ppl,
        simulator_ppl=ev.perplexity,
        service_train_loss=result.train_loss,
        simulator_train_loss=[sum(r) / len(r) for r in sim.losses],
        tolerance=CROSS_CHECK_TOLERANCE,
    )
