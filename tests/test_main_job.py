"""The main job (``python -m train`` defaults) and the kernel-fitting benchmark."""

from __future__ import annotations

import pytest

from train import bench, configs
from train.__main__ import REFERENCES, build_config, comparison_line, parse_args
from train.bench import kernel_fit


def _summary(attention, val, test, steps=500):
    return {
        "task": "listops",
        "preset": "mini",
        "attention": attention,
        "steps": steps,
        "val": {"accuracy": val},
        "test": {"accuracy": test},
    }


def test_default_main_job_and_its_softmax_reference():
    """The default run is flexformer_n on ListOps mini, and a stored softmax reference (with
    the command that produced it) exists for exactly its budget."""
    args, overrides = parse_args([])
    c = build_config(args, overrides)
    assert (c.task, c.preset, c.attention) == ("listops", "mini", "flexformer_n")
    key = (c.task, c.preset, c.num_train_steps)
    assert key in REFERENCES
    ref = REFERENCES[key]
    assert ref["command"].startswith("python -m train --attention softmax")
    assert 0.3 < ref["val"] < 1 and 0.3 < ref["test"] < 1
    line = comparison_line(_summary("flexformer_n", 0.3, 0.31, c.num_train_steps), None, args, [])
    assert "softmax val" in line and "stored reference" in line and "flexformer_n val 30.0%" in line
    # No reference line for a different budget, an override, or the softmax run itself.
    assert comparison_line(_summary("flexformer_n", 0.3, 0.3, 7), None, args, []) is None
    assert comparison_line(_summary("flexformer_n", 0.3, 0.3), None, args, ["seed=3"]) is None
    assert comparison_line(_summary("softmax", 0.3, 0.3), None, args, []) is None
    # --compare: the trained comparison is printed instead.
    other = _summary("softmax", 0.4, 0.41)
    line = comparison_line(_summary("flexformer_n", 0.3, 0.3), other, args, ["seed=3"])
    assert line.endswith("softmax val 40.0% / test 41.0%")
    args, _ = parse_args(["--compare", "softmax"])
    assert args.compare == "softmax"
    assert configs.get_config("listops", "mini").attention == "flexformer_n"


def test_kernel_fit_bench_runs():
    """Tiny run through `python -m train.bench kernel_fit`: one row per mechanism, finite
    errors, fitting does not hurt the learnable kernels; a bad budget is a clear error."""
    result = bench.main(
        ["kernel_fit", "--head-dim", "4", "--seq-len", "8", "--batch", "2", "--steps", "20",
         "--seeds", "1", "--quiet"]
    )  # fmt: skip
    rows = {r["mechanism"]: r for r in result["rows"]}
    assert set(rows) == set(kernel_fit.MECHANISMS)
    assert result["config"]["budget"] == 8
    for name in ("flexformer_n", "flexformer_s", "hedgehog"):
        assert rows[name]["fitted"] <= rows[name]["init"] + 1e-6, rows[name]
    assert rows["performer"]["fitted"] == rows["performer"]["init"]  # nothing to fit
    table = kernel_fit.table(result)
    assert table.count("\n| ") == 5  # header + 4 rows
    with pytest.raises(ValueError, match="budget"):
        kernel_fit.run(budget=3)
