"""Tables, plot, self-checks and target checks of a quality comparison (targets and checks: docs/QUALITY.md).

The report checks its own inputs before it judges a target (`sanity_flags`): a number that cannot be right is
flagged, and a target whose inputs are flagged is never shown as met. The checks catch what went wrong before
(a dense model trained on a corpus given in blocks of languages, its perplexity up and down by 2x between rounds,
a 2x2 "beating" it by 10x): held-out perplexity that rises between scored rounds by more than `RISE_LIMIT`, a
final perplexity outside [`RATIO_LOW`, `RATIO_HIGH`] x dense-S, an early-stopped test perplexity more than
`EARLY_STOP_GAP` below the final one (the model got much worse late), and a perplexity that is not a finite
number."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from dipaco.quality import CrossCheck, ModelResult

DENSE_S = "dense-S"
DIPACO_2X2 = "DiPaCo 2x2"
DIPACO_4X4 = "DiPaCo 4x4"
RATIO_TARGET = 0.85
"""DiPaCo 2x2 perplexity <= this x dense-S (same steps per path)."""
GAP_TARGET = 0.50
"""DiPaCo 2x2 closes at least this share of the dense-S -> wide-dense perplexity gap."""
RISE_LIMIT = 0.10
"""Held-out perplexity may rise by at most this fraction from one scored round to the next. Rounds of a healthy
run bring it down (at worst a few % of noise once it has converged); a rise past 10 % means the data (e.g. a shard
read in blocks of domains) or the optimisation is broken."""
RATIO_LOW, RATIO_HIGH = 0.5, 2.0
"""A model's final perplexity / dense-S's outside this range is implausible at the same steps per path: DiPaCo's
own gains are tens of %, and a wider dense model is never 2x worse. One of the two did not learn the corpus."""
EARLY_STOP_GAP = 0.10
"""Per-path early stopping may beat the final test perplexity by at most this fraction: more means the model
was much better some rounds ago, so its final number is not what it learned."""


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def find(results: Sequence[ModelResult], name: str) -> ModelResult | None:
    return next((r for r in results if r.name == name), None)


def _wider(results: Sequence[ModelResult]) -> list[ModelResult]:
    """Dense baselines larger than dense-S: one path, more parameters per path."""
    small = find(results, DENSE_S)
    return [
        r
        for r in results
        if r.num_paths == 1 and r.name != DENSE_S and (small is None or r.path_params > small.path_params)
    ]


def wide_dense(results: Sequence[ModelResult]) -> ModelResult | None:
    """The larger dense baseline trained like dense-S (the same steps per path): the gap target's reference."""
    small = find(results, DENSE_S)
    return next((r for r in _wider(results) if small is None or r.steps_per_path == small.steps_per_path), None)


def token_reference(results: Sequence[ModelResult]) -> ModelResult | None:
    """The larger dense baseline trained on more steps than dense-S (e.g. the 2x2's total tokens): reported for
    reference, never judged."""
    small = find(results, DENSE_S)
    if small is None:
        return None
    return next((r for r in _wider(results) if r.steps_per_path > small.steps_per_path), None)


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
class Flag:
    """A result the report does not believe."""

    model: str
    check: str
    """`rising`, `ratio`, `early_stop` or `not_finite`."""
    detail: str


def sanity_flags(results: Sequence[ModelResult]) -> list[Flag]:
    """Every implausible number among the results (see the module doc), in result order."""
    flags: list[Flag] = []
    base = find(results, DENSE_S)
    for r in results:
        ppls = r.ppl_per_round
        if not all(math.isfinite(x) for x in (*ppls, r.final_test_ppl, r.early_stopped_test_ppl)):
            flags.append(Flag(r.name, "not_finite", "a perplexity is not a finite number (no token scored, or NaN)"))
            continue
        for i in range(1, len(ppls)):
            (a, pa), (b, pb) = (r.rounds[i - 1], ppls[i - 1]), (r.rounds[i], ppls[i])
            if pb > pa * (1 + RISE_LIMIT):
                flags.append(
                    Flag(
                        r.name,
                        "rising",
                        f"held-out perplexity rose {pb / pa - 1:+.0%} from round {a} ({pa:.2f}) to round {b} "
                        f"({pb:.2f}); more than {RISE_LIMIT:.0%} means the model is not learning the corpus (shards "
                        "read in blocks of domains? too high a learning rate?)",
                    )
                )
        if base is not None and r is not base and math.isfinite(base.final_ppl):
            ratio = r.final_ppl / base.final_ppl
            if not RATIO_LOW <= ratio <= RATIO_HIGH:
                flags.append(
                    Flag(
                        r.name,
                        "ratio",
                        f"final perplexity {ratio:.3f}x {DENSE_S}'s ({r.final_ppl:.2f} vs {base.final_ppl:.2f}): "
                        f"outside [{RATIO_LOW}, {RATIO_HIGH}], so one of the two did not learn the corpus",
                    )
                )
        if r.early_stopped_test_ppl < r.final_test_ppl * (1 - EARLY_STOP_GAP):
            flags.append(
                Flag(
                    r.name,
                    "early_stop",
                    f"early-stopped test perplexity {r.early_stopped_test_ppl:.2f} is "
                    f"{1 - r.early_stopped_test_ppl / r.final_test_ppl:.0%} below the final {r.final_test_ppl:.2f}: "
                    "the model got much worse late in training",
                )
            )
    return flags


def flags_table(flags: Sequence[Flag]) -> Table:
    table = Table(title="results the report does not believe (targets on them are not judged met)")
    for col in ("model", "check", "why"):
        table.add_column(col)
    for f in flags:
        table.add_row(f.model, f.check, escape(f.detail))
    return table


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    value: float | None
    goal: str
    met: bool
    """False too when the target cannot be judged (`value` None): a benchmark that cannot judge it has failed."""
    why: str = ""
    """Why `value` is None: what is missing or undefined."""
    flagged: tuple[str, ...] = ()
    """Models among the target's inputs that `sanity_flags` does not believe: `met` is then False."""
    inputs: tuple[str, ...] = ()
    """The models the target is computed from."""
    judged: bool = True
    """False: reported for reference only (a benchmark does not fail on it)."""


def targets(results: Sequence[ModelResult]) -> list[Target]:
    """The quality targets (docs/QUALITY.md) on the final held-out perplexity: 2x2 <= 0.85x dense-S; 2x2 closes
    >= 50 % of the dense-S -> wide-dense gap; 4x4 < 2x2 (only when a 4x4 was run). A missing model or an undefined
    gap cannot be judged: `met` is False and `why` says what is missing. A target whose inputs are flagged by
    `sanity_flags` is never met (`flagged` names them)."""
    suspect = {f.model for f in sanity_flags(results)}
    return [_believed(t, suspect) for t in _targets(results)]


def _believed(target: Target, suspect: set[str]) -> Target:
    flagged = tuple(name for name in target.inputs if name in suspect)
    if not flagged:
        return target
    return dataclasses.replace(target, met=False, flagged=flagged)


def _targets(results: Sequence[ModelResult]) -> list[Target]:
    base, two, wide, four, reference = (
        find(results, DENSE_S),
        find(results, DIPACO_2X2),
        wide_dense(results),
        find(results, DIPACO_4X4),
        token_reference(results),
    )
    out = []
    ratio = two.final_ppl / base.final_ppl if two and base else None
    out.append(
        Target(
            f"{DIPACO_2X2} / {DENSE_S} perplexity",
            ratio,
            f"<= {RATIO_TARGET}",
            ratio is not None and ratio <= RATIO_TARGET,
            "" if ratio is not None else _missing(base=base, two=two),
            inputs=(DENSE_S, DIPACO_2X2),
        )
    )
    if wide is not None or reference is None:  # only a token reference: its gap is reported below, not judged
        gap, why = _gap(base, two, wide)
        out.append(
            Target(
                f"share of the {DENSE_S} -> {wide.name if wide else 'wide dense'} gap closed by {DIPACO_2X2}",
                gap,
                f">= {GAP_TARGET:.2f}",
                gap is not None and gap >= GAP_TARGET,
                why,
                inputs=(DENSE_S, DIPACO_2X2, *([wide.name] if wide else [])),
            )
        )
    if four is not None:
        rel = four.final_ppl / two.final_ppl if two else None
        out.append(
            Target(
                f"{DIPACO_4X4} / {DIPACO_2X2} perplexity",
                rel,
                "< 1",
                rel is not None and rel < 1,
                "" if rel is not None else f"no {DIPACO_2X2} result",
                inputs=(DIPACO_2X2, DIPACO_4X4),
            )
        )
    if reference is not None:
        gap, why = _gap(base, two, reference)
        out.append(
            Target(
                f"share of the {DENSE_S} -> {reference.name} gap closed by {DIPACO_2X2} (reference: "
                f"{reference.steps_per_path} steps)",
                gap,
                "reported",
                False,
                why,
                inputs=(DENSE_S, DIPACO_2X2, reference.name),
                judged=False,
            )
        )
    return out


def _gap(base: ModelResult | None, two: ModelResult | None, wide: ModelResult | None) -> tuple[float | None, str]:
    """(share of the dense-S -> wide perplexity gap closed by the 2x2, or None with why it is undefined)."""
    why = _missing(base=base, two=two)
    if wide is None:
        return None, why or "no wider dense model was trained"
    if base is not None and base.final_ppl <= wide.final_ppl:
        return None, why or (
            f"the wider dense model ended no better than {DENSE_S} ({_fmt(wide.final_ppl)} vs "
            f"{_fmt(base.final_ppl)}): there is no gap to close (too few steps for the wider model)"
        )
    if two is None or base is None:
        return None, why
    return (base.final_ppl - two.final_ppl) / (base.final_ppl - wide.final_ppl), ""


def _missing(*, base: ModelResult | None, two: ModelResult | None) -> str:
    names = [name for name, r in ((DENSE_S, base), (DIPACO_2X2, two)) if r is None]
    return f"no {' or '.join(names)} result" if names else ""


def targets_table(items: Sequence[Target]) -> Table:
    table = Table(title="quality targets")
    for col in ("target", "value", "goal", "met"):
        table.add_column(col)
    for t in items:
        if t.flagged:
            met = f"[yellow]not judged, inputs flagged:[/] {escape(', '.join(t.flagged))}"
        elif t.value is None:
            met = f"[yellow]cannot judge:[/] {escape(t.why or 'no value')}"
        elif not t.judged:
            met = "reference"
        else:
            met = "[green]yes[/]" if t.met else "[red]NO[/]"
        table.add_row(t.name, _fmt(t.value, ".3f"), t.goal, met)
    return table


def all_met(items: Sequence[Target]) -> bool:
    """Every judged target met (a flagged or unjudgeable one is not)."""
    return all(t.met for t in items if t.judged)


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
