"""The quality driver's bookkeeping, tables, targets and plot, on hand-made results (no training here)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from rich.console import Console

from dipaco import quality_report as qr
from dipaco.quality import Contender, CrossCheck, ModelResult, QualitySettings, split_heldout, standard_contenders


def result(name: str, ppls: list[float], *, paths: int = 1, params: int = 100) -> ModelResult:
    """A result whose every path scores loss log(ppl) on 10 tokens of each half, at every round."""
    halves = [{h: [(math.log(p) * 10, 10)] * paths for h in ("val", "test")} for p in ppls]
    return ModelResult(
        name=name,
        layout="x",
        num_paths=paths,
        path_params=params,
        total_params=params * paths,
        steps_per_path=10,
        tokens_per_path=100,
        rounds=list(range(len(ppls))),
        halves=halves,
    )


def render(table: object) -> str:
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def test_perplexity_bookkeeping_and_early_stopping() -> None:
    r = result("m", [100.0, 20.0, 10.0], paths=2)
    assert r.ppl_per_round == pytest.approx([100.0, 20.0, 10.0])
    assert r.final_ppl == pytest.approx(10.0) and r.final_test_ppl == pytest.approx(10.0)
    # Path 1 overfits after round 1 on validation: early stopping takes round 1 for it, on the test half.
    r.halves[2]["val"][1] = (math.log(30.0) * 10, 10)
    r.halves[2]["test"][1] = (math.log(40.0) * 10, 10)
    assert r.early_stopped_test_ppl == pytest.approx(math.exp((math.log(10.0) + math.log(20.0)) / 2))
    assert r.final_test_ppl == pytest.approx(math.exp((math.log(10.0) + math.log(40.0)) / 2))
    assert r.to_dict()["final_test_ppl"] == pytest.approx(r.final_test_ppl)


def test_targets_met_and_missed() -> None:
    dense = result("dense-S", [200.0, 10.0], params=100)
    wide = result("dense-2w", [200.0, 6.0], params=350)
    good = result("DiPaCo 2x2", [200.0, 7.5], paths=4)
    got = qr.targets([dense, good, wide])
    assert [t.met for t in got] == [True, True]
    assert got[0].value == pytest.approx(0.75) and got[1].value == pytest.approx(2.5 / 4)
    bad = result("DiPaCo 2x2", [200.0, 9.0], paths=4)
    four = result("DiPaCo 4x4", [200.0, 9.5], paths=16)
    got = qr.targets([dense, bad, wide, four])
    assert [t.met for t in got] == [False, False, False]
    assert got[2].value == pytest.approx(9.5 / 9.0)
    # No wide model, or a wide model worse than dense-S: the gap is undefined, which is a miss.
    assert qr.targets([dense, good])[1].value is None and not qr.targets([dense, good])[1].met
    worse = result("dense-2w", [200.0, 11.0], params=350)
    assert not qr.targets([dense, good, worse])[1].met
    # a target that cannot be judged says why instead of a bare NO
    unjudged = render(qr.targets_table(qr.targets([dense, good, worse])))
    assert "cannot judge: the wider dense model ended no better than dense-S (11.00 vs 10.00)" in unjudged
    assert "no wider dense model was trained" in render(qr.targets_table(qr.targets([dense, good])))
    assert "no DiPaCo 2x2 result" in render(qr.targets_table(qr.targets([dense, wide])))
    text = render(qr.targets_table(got))
    assert "NO" in text and "<= 0.85" in text


def test_tables_render() -> None:
    results = [result("dense-S", [200.0, 10.0]), result("DiPaCo 2x2", [200.0, 8.0], paths=4)]
    results[1].purity = 0.62
    text = render(qr.comparison_table(results, title="t"))
    assert "DiPaCo 2x2" in text and "0.800" in text and "0.62" in text and "re-routed" not in text
    results[1].reroute_ppl = 8.5
    assert "8.50" in render(qr.comparison_table(results))
    text = render(qr.rounds_table(results))
    assert "200.00" in text and "8.00" in text
    check = CrossCheck(
        name="dense-S",
        service_ppl=10.0,
        simulator_ppl=10.05,
        service_train_loss=[3.0, 2.0],
        simulator_train_loss=[3.0, 2.01],
        tolerance=0.01,
    )
    assert check.ok and check.max_train_loss_diff == pytest.approx(0.01)
    assert "yes" in render(qr.cross_check_table([check]))


def test_plot_writes_a_png_with_labels(tmp_path: Path) -> None:
    import matplotlib.image

    results = [result("dense-S", [200.0, 20.0, 10.0]), result("DiPaCo 2x2", [200.0, 15.0, 8.0], paths=4)]
    path = qr.plot(results, tmp_path / "sub" / "q.png", title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(str(path)).shape[2] in (3, 4)


def test_contenders_and_settings() -> None:
    names = [c.name for c in standard_contenders("debug", with_4x4=True)]
    assert names == ["dense-S", "DiPaCo 2x2", "flat 4", "dense-2w", "DiPaCo 4x4"]
    c = {c.name: c for c in standard_contenders("small", with_4x4=True)}
    assert c["DiPaCo 2x2"].layout == "embed:shared, b0-1:routed2, b2-3:routed2, head:shared"
    assert c["dense-S"].num_paths == 1 and c["DiPaCo 4x4"].num_paths == 16 and c["flat 4"].num_paths == 4
    # Same path size for the routed layouts; the wide dense has ~3.5-4x the parameters of a path.
    assert c["DiPaCo 2x2"].path_params() == c["dense-S"].path_params() == c["flat 4"].path_params()
    assert 3.0 < c["dense-2w"].path_params() / c["dense-S"].path_params() < 4.5
    assert c["DiPaCo 2x2"].total_params() < c["flat 4"].total_params() < 4 * c["dense-S"].path_params()
    assert QualitySettings(rounds=5, eval_every=2).eval_rounds() == [0, 2, 4, 5]
    with pytest.raises(ValueError, match="routing"):
        QualitySettings(routing="nope")


def test_heldout_halves_are_stable() -> None:
    docs = [f"document {i}" for i in range(11)]
    a, b = split_heldout(docs), split_heldout(list(reversed(docs)))
    assert a == b and len(a["val"]) == 6 and len(a["test"]) == 5
    assert sorted(a["val"] + a["test"]) == sorted(docs)
    small = split_heldout(docs, max_docs=4)
    assert len(small["val"]) + len(small["test"]) == 4
    assert (
        Contender(name="x", model={"flavour": "debug"}, layout="embed:shared, b0-1:shared, head:shared").num_paths == 1
    )


def test_contenders_take_the_block() -> None:
    for block in ("gpt2", "llama"):
        c = {c.name: c for c in standard_contenders("debug", block=block)}
        assert {x.config().block for x in c.values()} == {block}
        assert c["dense-S"].model == {"flavour": "debug", "block": block}
    gpt2, llama = (standard_contenders("debug", block=b)[0].path_params() for b in ("gpt2", "llama"))
    assert (gpt2, llama) == (137_088, 137_024)  # equal parameters per path (ModelConfig.mlp_hidden)
    assert "block" not in standard_contenders("debug")[0].model  # unset: the flavour's block


def test_report_flags_what_cannot_be_right_and_judges_no_target_on_it() -> None:
    # The numbers of a corpus given in blocks of languages (issue 18): dense models up and down by 2x between
    # rounds, a 2x2 ten times "better". The report must not call the targets met.
    dense = result("dense-S", [87.0, 168.0, 81.0, 172.0])
    two = result("DiPaCo 2x2", [27.0, 19.0, 16.0, 16.4], paths=4)
    wide = result("dense-2w", [95.0, 262.0, 151.0, 245.0], params=350)
    flags = qr.sanity_flags([dense, two, wide])
    assert {(f.model, f.check) for f in flags} == {
        ("dense-S", "rising"),
        ("dense-S", "early_stop"),  # round 2's 81 beats the final 172
        ("dense-2w", "rising"),
        ("dense-2w", "early_stop"),
        ("DiPaCo 2x2", "ratio"),
    }
    assert "rose +93% from round 0 (87.00) to round 1 (168.00)" in flags[0].detail
    got = qr.targets([dense, two, wide])
    assert (
        got[0].value == pytest.approx(16.4 / 172.0) and not got[0].met and got[0].flagged == ("dense-S", "DiPaCo 2x2")
    )
    assert not qr.all_met(got)
    text = render(qr.targets_table(got))
    assert "not judged, inputs flagged" in text and "yes" not in text
    assert "rising" in render(qr.flags_table(flags))
    # Healthy numbers (the same corpus shuffled) raise no flag; a small late rise within 10 % is noise.
    dense = result("dense-S", [200.0, 20.0, 14.0, 13.6])
    two = result("DiPaCo 2x2", [200.0, 18.0, 12.4, 12.6], paths=4)
    assert qr.sanity_flags([dense, two]) == []
    # A perplexity that is not a number, and a model much better some rounds before its end.
    nan = result("DiPaCo 2x2", [200.0, float("nan")], paths=4)
    assert [f.check for f in qr.sanity_flags([nan])] == ["not_finite"]
    late = result("dense-S", [200.0, 10.0, 10.5])
    late.halves[1]["test"] = [(math.log(8.0) * 10, 10)]
    late.halves[2]["test"] = [(math.log(20.0) * 10, 10)]
    assert "early_stop" in [f.check for f in qr.sanity_flags([late])]
