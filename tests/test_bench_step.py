"""normbook-bench step (normbook.bench.step): a Llama-shaped training step with Hugging Face's
norms, normbook's and Liger's. Here on the CPU with a tiny model, whose times mean nothing:
that every variant runs, swaps what it says, and that the strict swap keeps Hugging Face's
loss to the bit in bf16 (the torch backend), which the loose one need not."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from normbook.bench import step  # noqa: E402
from normbook.bench.cli import main  # noqa: E402


def test_quick_step_runs_every_variant_and_writes_what_it_says(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["step", "--quick", "--device", "cpu", "--json", str(out)]) == 0
    found = json.loads(out.read_text())
    rows = {r["variant"]: r for r in found["rows"]}
    assert list(rows) == list(step.VARIANTS)
    layers = found["shape"]["layers"]
    norms = 2 * layers + 1                        # two per decoder layer and the final one
    assert rows["hf"]["norms_swapped"] == 0 and rows["hf"]["speedup_vs_hf"] == 1.0
    for name in ("normbook", "normbook_loose"):
        assert rows[name]["norms_swapped"] == norms and rows[name]["ms"] > 0
        assert rows[name]["speedup_vs_hf"] == pytest.approx(rows["hf"]["ms"] / rows[name]["ms"])
    # strict in bf16 on the torch backend: Hugging Face's operations, so its loss to the bit
    assert found["dtype"] == "bf16" and rows["normbook"]["loss_minus_hf"] == 0.0
    assert rows["liger"]["ms"] is None and "GPU" in rows["liger"]["skipped"]
    assert found["transformers"] and found["device"] == "cpu"
    printed = capsys.readouterr().out
    assert "liger           not run: Liger-Kernel needs a GPU" in printed
    assert "normbook_loose" in printed and "x as fast as hf's step" in printed


def test_the_goal_is_normbook_strict_over_hf():
    rows = [dict(variant="hf", ms=10.0, speedup_vs_hf=1.0),
            dict(variant="normbook", ms=8.5, speedup_vs_hf=10 / 8.5),
            dict(variant="normbook_loose", ms=7.0, speedup_vs_hf=10 / 7)]
    text, ok = step.report(rows, judge=True)
    assert not ok and "FAIL (1.176x)" in text          # the loose swap's 1.43x does not count
    rows[1].update(ms=8.0, speedup_vs_hf=1.25)
    text, ok = step.report(rows, judge=True)
    assert ok and "PASS (1.250x)" in text
    assert "goal" not in step.report(rows, judge=False)[0]


def test_it_refuses_heads_that_do_not_divide_the_width(capsys):
    with pytest.raises(SystemExit):
        main(["step", "--quick", "--hidden", "60", "--heads", "8"])
    assert "--hidden: expected a multiple of --heads (8), got 60" in capsys.readouterr().err


def test_it_refuses_an_unknown_variant(capsys):
    with pytest.raises(SystemExit):
        main(["step", "--quick", "--variants", "hf,apex"])
    assert "(unknown: apex)" in capsys.readouterr().err
