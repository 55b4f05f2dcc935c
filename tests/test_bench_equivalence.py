"""`train.bench.equivalence`: the harness around the training runs (one run per arm and
seed in its own directory, the curves read back from metrics.jsonl, the table). The
training itself is `train.loop.train_and_evaluate`, tested in test_train*.py; here it is
replaced by a stand-in that writes the files a run writes, so the test takes no training."""

import json

import pytest

from train.bench import equivalence
from train.bench.__main__ import build_parser


def _fake_train(calls):
    """A `train_and_evaluate` that logs two train and two val records and a test accuracy
    that depends on the arm's mechanism and the seed."""

    def train_and_evaluate(config, workdir):
        workdir.mkdir(parents=True)
        calls.append((config.attention, config.seed, config.num_train_steps, workdir))
        acc = 0.5 + 0.1 * config.seed + (0.2 if config.attention == "performer_peer" else 0.0)
        records = [
            {"split": "train", "step": 10, "loss": 2.0},
            {"split": "val", "step": 10, "accuracy": 0.4},
            {"split": "train", "step": 20, "loss": 1.0},
            {"split": "val", "step": 20, "accuracy": acc},
        ]
        (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return {"test": {"accuracy": acc}}

    return train_and_evaluate


def test_every_arm_and_seed_runs_in_its_directory_and_the_table_reads_the_curves(
    tmp_path, monkeypatch, capsys
):
    calls = []
    monkeypatch.setattr(equivalence.loop, "train_and_evaluate", _fake_train(calls))
    out = tmp_path / "result.json"
    args = build_parser().parse_args(
        ["equivalence", "--mechanism", "performer", "--seeds", "0", "1", "--steps", "20",
         "--arms", "ours", "public", "--workdir", str(tmp_path / "w"), "--out", str(out),
         "--quiet"]
    )  # fmt: skip
    result = equivalence.main_from_args(args)
    assert [(a, s, n) for a, s, n, _ in calls] == [
        ("performer", 0, 20), ("performer", 1, 20),
        ("performer_peer", 0, 20), ("performer_peer", 1, 20),
    ]  # fmt: skip
    assert calls[3][3] == tmp_path / "w" / "performer" / "public" / "seed1"
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))  # tuples: lists
    ours, public = result["rows"]
    assert ours["test"] == pytest.approx([0.5, 0.6]) and public["test"] == pytest.approx([0.7, 0.8])
    assert ours["runs"][0]["train_loss"] == [(10, 2.0), (20, 1.0)]
    assert public["runs"][1]["val_accuracy"] == [(10, 0.4), (20, pytest.approx(0.8))]
    printed = capsys.readouterr().out
    assert printed.strip() == equivalence.table(result)
    # at 25% and 50% of 20 steps the curves are at step 10; at 75% and 100% at step 20
    assert "| ours | performer | 55.0 (7.1) | 50.0, 60.0 | 2.000 / 40.0 | 2.000 / 40.0 |" \
        " 1.000 / 55.0 | 1.000 / 55.0 |" in printed  # fmt: skip
    assert "| public | performer_peer | 75.0 (7.1) |" in printed


def test_a_run_without_metrics_has_empty_curves_and_bad_names_raise(tmp_path):
    assert equivalence.curves(tmp_path) == {"train_loss": [], "val_accuracy": []}
    with pytest.raises(ValueError, match="task must be one of"):
        equivalence.arm_config("listops", "performer", "ours", 0)
    with pytest.raises(ValueError, match="arm must be one of"):
        equivalence.arm_config("pathfinder", "performer", "theirs", 0)
    quick = equivalence.arm_config("pathfinder", "rfa", "ours", 0, quick=True)
    assert quick.num_train_steps == 4 and quick.data.num_train == 64
