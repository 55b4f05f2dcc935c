"""Training equivalence: ``python -m train.bench equivalence --mechanism performer``.

A mechanism is correct when it trains as its public code does, not only when one call
agrees. This benchmark trains, in the same model, config, data and seeds, three arms:

* ``ours``: the registered mechanism with its defaults (features drawn at init and kept);
* ``ours_redraw_call``: the same with ``redraw="call"`` (fresh features at every training
  call, the behaviour of this library before the redraw policy existed); only for the
  mechanisms that draw features (`default_arms`);
* ``public``: a faithful stand-in of the public algorithm (`training_peers.training_peer`): the
  public Performer-JAX FAVOR+ with its query-seeded redraw, the public RFA's bank of
  stored matrices sampled once per step, the Hedgehog paper's exp map with separate query
  and key maps, or fast-transformers' elu + 1 attention.

and prints each arm's train-loss and validation-accuracy curves and its test accuracy
(mean and sample std over the seeds, each seed's value). The default task is the
equal-budget table's Pathfinder mini (`TASKS`, the settings of ``train.claims.table``):
softmax learns it, and a random-feature kernel that changes every step does not.
Each run lives in ``<workdir>/<mechanism>/<arm>/seed<N>`` and is resumed or re-read
when it is there (`train.loop.train_and_evaluate`).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
from pathlib import Path

import linattn_jax as la
from train import configs, loop
from train.bench import common, training_peers
from train.metrics import read_jsonl

#: task -> (preset, config overrides); ``train.claims.table.TASKS`` trains its Pathfinder
#: runs on these settings too, so the two benchmarks' runs are the same runs.
TASKS = {
    "pathfinder": (
        "mini",
        {
            "data.num_train": 100_000,
            "data.num_val": 1000,
            "data.num_test": 2000,
            "num_train_steps": 5000,
        },
    ),
}
#: tiny sizes for a smoke run (``--quick``)
QUICK = {"num_train_steps": 4, "data.num_train": 64, "data.num_val": 32, "data.num_test": 32}
ARMS = ("ours", "ours_redraw_call", "public")


def default_arms(mechanism: str) -> tuple[str, ...]:
    """`ARMS` for a mechanism with a ``redraw`` option, else ``("ours", "public")``."""
    return ARMS if _redraws(mechanism) else ("ours", "public")


def _redraws(mechanism: str) -> bool:
    return "redraw" in inspect.signature(la.get(mechanism).attention_fn).parameters


def arm_config(task: str, mechanism: str, arm: str, seed: int, *, steps=None, quick=False):
    """The training config of one arm (`ARMS`) of `mechanism` on `task` for `seed`: the
    task's preset and overrides, the mechanism's mini settings (the public arm gets the
    same ``num_features``)."""
    if task not in TASKS:
        raise ValueError(f"equivalence: task must be one of {tuple(TASKS)}, got {task!r}")
    if arm not in ARMS:
        raise ValueError(f"equivalence: arm must be one of {ARMS}, got {arm!r}")
    if arm == "ours_redraw_call" and not _redraws(mechanism):
        raise ValueError(f"equivalence: {mechanism} draws no features, so it has no {arm!r} arm")
    preset, changes = TASKS[task]
    config = configs.get_config(task, preset)
    configs.set_attention(config, mechanism)
    options = config.attention_config.to_dict()
    if arm == "public":
        configs.set_attention(config, training_peers.training_peer(mechanism))
        config.attention_config.update(options)
    elif arm == "ours_redraw_call":
        config.attention_config.redraw = "call"
    overrides = {**changes, **(QUICK if quick else {}), "seed": seed}
    if steps is not None:
        overrides["num_train_steps"] = steps
    configs.apply_overrides(config, [f"{k}={v}" for k, v in overrides.items()])
    config.progress_bar = False
    return config


def curves(workdir: Path) -> dict[str, list[tuple[int, float]]]:
    """``{"train_loss": [(step, loss)], "val_accuracy": [(step, acc)]}`` of a run."""
    out = {"train_loss": [], "val_accuracy": []}
    path = Path(workdir) / "metrics.jsonl"
    if path.is_file():
        for r in read_jsonl(path):
            if r.get("split") == "train" and "loss" in r:
                out["train_loss"].append((r["step"], float(r["loss"])))
            if r.get("split") == "val" and "accuracy" in r:
                out["val_accuracy"].append((r["step"], float(r["accuracy"])))
    return out


def run(mechanism, *, task="pathfinder", seeds=(0,), arms=None, steps=None, quick=False,
        workdir="workdir/equivalence", log=print) -> dict:  # fmt: skip
    """Trains (or re-reads) every arm (default `default_arms`) for every seed; ``{"rows":
    [...]}``, one row per arm with its seeds' test accuracies and curves."""
    rows = []
    arms = default_arms(mechanism) if arms is None else arms
    for arm in arms:
        accs, runs = [], []
        for seed in seeds:
            config = arm_config(task, mechanism, arm, seed, steps=steps, quick=quick)
            path = Path(workdir) / mechanism / arm / f"seed{seed}"
            if log:
                log(f"equivalence {mechanism} {arm} seed {seed}: {config.attention} in {path}")
            summary = loop.train_and_evaluate(config, path)
            accs.append(float(summary["test"]["accuracy"]))
            runs.append({"seed": seed, "test_accuracy": accs[-1], **curves(path)})
        rows.append({"arm": arm, "attention": config.attention, "test": accs, "runs": runs})
    return {"kind": "equivalence", "mechanism": mechanism, "task": task, "rows": rows}


def _at(curve, fraction):
    """The value of a ``[(step, value)]`` curve at the first step >= fraction of its last."""
    if not curve:
        return float("nan")
    last = curve[-1][0]
    return next(v for s, v in curve if s >= fraction * last)


def table(result: dict) -> str:
    """Markdown: per arm, test accuracy (mean, std, seeds) and the curves at 4 points."""
    points = (0.25, 0.5, 0.75, 1.0)
    head = " | ".join(f"loss / val @{int(p * 100)}%" for p in points)
    lines = [
        f"Training equivalence: {result['mechanism']} on {result['task']}",
        "",
        f"| arm | attention | test % mean (std) | seeds | {head} |",
        "|---|---|---|---|" + "---|" * len(points),
    ]
    for row in result["rows"]:
        accs = [100 * a for a in row["test"]]
        std = statistics.stdev(accs) if len(accs) > 1 else float("nan")
        cells = []
        for p in points:
            loss = statistics.mean(_at(r["train_loss"], p) for r in row["runs"])
            val = statistics.mean(_at(r["val_accuracy"], p) for r in row["runs"])
            cells.append(f"{loss:.3f} / {100 * val:.1f}")
        seeds = ", ".join(f"{a:.1f}" for a in accs)
        lines.append(
            f"| {row['arm']} | {row['attention']} | {statistics.mean(accs):.1f} ({std:.1f}) |"
            f" {seeds} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mechanism", required=True, choices=sorted(training_peers.TRAINING_PEERS))
    p.add_argument("--task", default="pathfinder", choices=sorted(TASKS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--arms", nargs="+", default=None, choices=ARMS, help="default: every arm"
                   " the mechanism has (`default_arms`)")  # fmt: skip
    p.add_argument("--steps", type=int, default=None, help="train steps (default the task's)")
    p.add_argument("--workdir", default="workdir/equivalence")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--out", default=None, help="JSON results path")
    p.add_argument("--quiet", action="store_true")


def main_from_args(args: argparse.Namespace) -> dict:
    """Run with parsed `add_arguments` flags, print the table, write ``--out``."""
    result = run(
        args.mechanism,
        task=args.task,
        seeds=tuple(args.seeds),
        arms=None if args.arms is None else tuple(args.arms),
        steps=args.steps,
        quick=args.quick,
        workdir=args.workdir,
        log=None if args.quiet else lambda m: print(m, flush=True),
    )
    print(table(result))
    common.write_json(result, args.out)
    return result
