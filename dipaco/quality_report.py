"""Tables, plot and target checks of a quality comparison (the quality targets are in docs/QUALITY.md)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from dipaco.quality import CrossCheck, ModelResult

DENSE_S = "dense-S"
DIPACO_2X2 = "DiPaCo 2x2"
DIPACO_4X4 = "DiPaCo 4x4"
RATIO_TARGET = 0.85
"""DiPaCo 2x2 perplexity <= this x dense-S (same steps per path)."""
GAP_TARGET = 0.50
"""DiPaCo 2x2 closes at least this share of the dense-S -> wide-dense perplexity gap."""


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def find(results: Sequence[ModelResult], name: str) -> ModelResult | None:
    return next((r for r in results if r.name == name), None)


def wide_dense(results: Sequence[ModelResult]) -> ModelResult | None:
    """The larger dense baseline (one path, more parameters per path than dense-S)."""
    small = find(results, DENSE_S)
    return next(
        (
            r
            for r in results
            if r.num_paths == 1 and r.name != DENSE_S and (small is None or r.path_params > small.path_params)
        ),
        None,
    )


def comparison_table(results: Sequence[ModelResult], *, title: str = "held-out routed perplexity") -> Table:
    """One row per model: sizes, final perplexity, ratio to dense-S, test-half numbers (compact: fits 80 columns)."""
    base = find(results, DENSE_S)
    reroute = any(r.reroute_ppl is not None for r in results)
    table = Table(title=title)
    cols = [
        "model",
        "paths",
        "params /path",
        "params total",
        "ppl",
        "x dense-S",
        "test ppl",
        "test, early stop",
        *(["re-routed"] if reroute else []),
        "purity",
    ]
    for col in cols:
        table.add_column(col, justify="left" if col == "model" else "right")
    for r in results:
        ratio = r.final_ppl / base.final_ppl if base is not None else None
        table.add_row(
            r.name,
            str(r.num_paths),
            f"{r.path_params / 1e3:.0f}k",
            f"{r.total_params / 1e3:.0f}k",
            _fmt(r.final_ppl),
            _fmt(ratio, ".3f"),
            _fmt(r.final_test_ppl),
            _fmt(r.early_stopped_test_ppl),
            *([_fmt(r.reroute_ppl)] if reroute else []),
            _fmt(r.purity),
        )
    return table


def rounds_table(results: Sequence[ModelResult]) -> Table:
    """Held-out perplexity at every scored round (module version), one column per model."""
    table = Table(title="held-out routed perplexity per round (version v = after round v-1)")
    table.add_column("round", justify="right")
    for r in results:
        table.add_column(r.name, justify="right")
    rounds = sorted({x for r in results for x in r.rounds})
    for rnd in rounds:
        cells = [_fmt(r.ppl_per_round[r.rounds.index(rnd)]) if rnd in r.rounds else "-" for r in results]
        table.add_row(str(rnd), *cells)
    return table


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    value: float | None
    goal: str
    met: bool


def targets(results: Sequence[ModelResult]) -> list[Target]:
    """Issue 7's targets on the final held-out perplexity: 2x2 <= 0.85x dense-S; 2x2 closes >= 50 % of the dense-S
    -> wide-dense gap; 4x4 < 2x2 (only when a 4x4 was run). A missing model or an undefined gap is a miss."""
    base, two, wide, four = (
        find(results, DENSE_S),
        find(results, DIPACO_2X2),
        wide_dense(results),
        find(results, DIPACO_4X4),
    )
    out = []
    ratio = two.final_ppl / base.final_ppl if two and base else None
    out.append(
        Target(
            f"{DIPACO_2X2} / {DENSE_S} perplexity",
            ratio,
            f"<= {RATIO_TARGET}",
            ratio is not None and ratio <= RATIO_TARGET,
        )
    )
    gap: float | None = None
    if two and base and wide and base.final_ppl > wide.final_ppl:
        gap = (base.final_ppl - two.final_ppl) / (base.final_ppl - wide.final_ppl)
    out.append(
        Target(
            f"share of the {DENSE_S} -> {wide.name if wide else 'wide dense'} gap closed by {DIPACO_2X2}",
            gap,
            f">= {GAP_TARGET:.2f}",
            gap is not None and gap >= GAP_TARGET,
        )
    )
    if four is not None:
        rel = four.final_ppl / two.final_ppl if two else None
        out.append(Target(f"{DIPACO_4X4} / {DIPACO_2X2} perplexity", rel, "< 1", rel is not None and rel < 1))
    return out


def targets_table(items: Sequence[Target]) -> Table:
    table = Table(title="quality targets")
    for col in ("target", "value", "goal", "met"):
        table.add_column(col)
    for t in items:
        table.add_row(t.name, _fmt(t.value, ".3f"), t.goal, "[green]yes[/]" if t.met else "[red]NO[/]")
    return table


def cross_check_table(checks: Sequence[CrossCheck]) -> Table:
    table = Table(title="service vs in-process simulator (modules.simulate)")
    for col in ("model", "service ppl", "simulator ppl", "rel. diff", "tolerance", "max |train loss diff|", "ok"):
        table.add_column(col)
    for c in checks:
        table.add_row(
            c.name,
            f"{c.service_ppl:.4f}",
            f"{c.simulator_ppl:.4f}",
            f"{c.rel_diff:.2e}",
            f"{c.tolerance:.0e}",
            f"{c.max_train_loss_diff:.2e}",
            "[green]yes[/]" if c.ok else "[red]NO[/]",
        )
    return table


def plot(results: Sequence[ModelResult], path: Path, *, title: str = "held-out routed perplexity") -> Path:
    """PNG of held-out perplexity per round, one line per model (matplotlib, Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    try:
        for r in results:
            ax.plot(r.rounds, r.ppl_per_round, marker="o", label=f"{r.name} ({r.path_params / 1e3:.0f}k/path)")
        ax.set_xlabel("outer round (module version)")
        ax.set_ylabel("held-out perplexity (routed, prefix excluded)")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path
