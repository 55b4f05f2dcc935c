"""``python -m train.results``: the mini-LRA table, every mechanism on every task, one budget.

    python -m train.results --tasks listops,pathfinder \\
        --attentions softmax,performer,flexformer_n --steps 500 --workdir results

Runs ``train_and_evaluate`` for each (task, attention) pair with the same preset, steps and
seed (a finished run in ``<workdir>/<task>/<attention>`` is resumed, i.e. just re-read),
then writes ``<workdir>/results.md`` (accuracy table with the majority-class baseline,
plus speed / size / memory per run), ``results.json`` and ``results.png`` (grouped bars).
A run that fails (missing data set, unsupported mechanism) is reported in the table and
the others go on.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from train import cli


def run_config(task, attention, steps, preset, overrides=(), progress=True):
    """The config of one (task, attention) run of the table."""
    flags = argparse.Namespace(
        task=task, preset=preset, attention=attention, steps=steps, no_progress=not progress
    )
    return cli.build_config(flags, overrides)


def run_all(
    tasks: Sequence[str],
    attentions: Sequence[str],
    *,
    steps: int | None,
    preset: str = "mini",
    workdir: str | Path = "results",
    overrides: Sequence[str] = (),
    progress: bool = True,
    restart: bool = False,
) -> list[dict[str, Any]]:
    """Train every (task, attention) pair; returns one row per run (summary or error).

    ``restart``: start every run over (`train.loop.train_and_evaluate`)."""
    from train import loop

    rows = []
    for task in tasks:
        for attention in attentions:
            config = run_config(task, attention, steps, preset, overrides, progress)
            run_dir = Path(workdir) / task / attention
            try:
                summary = loop.train_and_evaluate(config, run_dir, restart=restart)
                print(loop.format_summary(summary), flush=True)
                rows.append({"task": task, "attention": attention, "summary": summary})
            except Exception as e:  # one failed run must not lose the table
                if cli.expected_error(e):  # a refused workdir, missing data: one line
                    print(cli.error_line(e), file=sys.stderr, flush=True)
                else:
                    traceback.print_exc()
                rows.append(
                    {"task": task, "attention": attention, "error": f"{type(e).__name__}: {e}"}
                )
    return rows


def _acc(summary, split):
    return (summary.get(split) or {}).get("accuracy")


def _fmt(x, pct=True):
    if x is None:
        return "—"
    return f"{100 * x:.1f}" if pct else f"{x:.2f}"


def markdown_table(rows: Sequence[dict[str, Any]], *, steps=None, preset="mini") -> str:
    """Accuracy table (attention x task, test accuracy %) and a per-run detail table."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    attentions = list(dict.fromkeys(r["attention"] for r in rows))
    by = {(r["task"], r["attention"]): r for r in rows}
    out = [
        f"Test accuracy (%) after {steps if steps is not None else 'the preset number of'} "
        f"steps, preset `{preset}` (same budget and seed for every mechanism).",
        "",
        "| attention | " + " | ".join(tasks) + " | mean |",
        "|---|" + "---|" * (len(tasks) + 1),
    ]
    for a in attentions:
        cells, accs = [], []
        for t in tasks:
            r = by.get((t, a))
            if r is None or "error" in r:
                cells.append("error" if r else "—")
                continue
            acc = _acc(r["summary"], "test") or _acc(r["summary"], "val")
            accs.append(acc)
            cells.append(_fmt(acc))
        mean = sum(accs) / len(accs) if accs and len(accs) == len(tasks) else None
        out.append(f"| {a} | " + " | ".join(cells) + f" | {_fmt(mean)} |")
    majority = []
    for t in tasks:
        ok = [r for r in rows if r["task"] == t and "error" not in r]
        m = (
            ((ok[0]["summary"].get("test") or ok[0]["summary"].get("val") or {}).get("majority"))
            if ok
            else None
        )
        majority.append(_fmt(m))
    out.append("| *majority class* | " + " | ".join(majority) + " | |")
    out += [
        "",
        "| task | attention | val acc | test acc | best val (step) | steps/s | params | "
        "train-step memory (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['task']} | {r['attention']} | error: {r['error'][:80]} | | | | | |")
            continue
        s = r["summary"]
        best = s.get("best") or {}
        mem = (s.get("memory") or {}).get("compiled_train_step") or {}
        mib = mem.get("estimated_peak_bytes")
        sps = _fmt(s.get("steps_per_sec"), False)
        out.append(
            f"| {r['task']} | {r['attention']} | {_fmt(_acc(s, 'val'))} | {_fmt(_acc(s, 'test'))} "
            f"| {_fmt(best.get('value'))} ({best.get('step')}) | {sps} "
            f"| {s['params']:,} | {'—' if mib is None else f'{mib / 2**20:.0f}'} |"
        )
    return "\n".join(out) + "\n"


def plot(rows: Sequence[dict[str, Any]], png: str | Path) -> Path:
    """Grouped bars: test accuracy per task, one bar per attention; majority as a tick."""
    bars, majority = {}, {}
    for r in rows:
        s = r.get("summary")
        bars[r["task"], r["attention"]] = (
            100 * ((_acc(s, "test") or _acc(s, "val")) or 0.0) if s else 0.0
        )
        if s and "error" not in r and r["task"] not in majority:
            m = (s.get("test") or s.get("val") or {}).get("majority")
            if m is not None:
                majority[r["task"]] = 100 * m
    return grouped_bars(bars, png, title="mini-LRA (dashed: majority class)", lines=majority)


def grouped_bars(
    bars: dict[tuple[str, str], float | tuple[float, float]],
    png: str | Path,
    *,
    title: str,
    ylabel: str = "test accuracy (%)",
    lines: dict[str, float] | None = None,
) -> Path:
    """Bars ``{(group, name): value or (value, error bar)}``, grouped by `group` (in order of
    appearance), one colour per `name`; `lines`: a dashed level per group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    groups = list(dict.fromkeys(g for g, _ in bars))
    names = list(dict.fromkeys(n for _, n in bars))
    width = 0.8 / max(len(names), 1)
    width_in = max(5.0, 1.5 + 0.45 * len(groups) * (len(names) + 1))
    fig, ax = plt.subplots(figsize=(width_in, 4.0))
    x = np.arange(len(groups))
    for i, n in enumerate(names):
        cells = [bars.get((g, n), 0.0) for g in groups]
        vals = [c[0] if isinstance(c, tuple) else c for c in cells]
        errs = [c[1] if isinstance(c, tuple) else 0.0 for c in cells]
        has_err = any(isinstance(c, tuple) for c in cells)
        ax.bar(x + (i - (len(names) - 1) / 2) * width, vals, width, label=n,
               yerr=errs if has_err else None, capsize=2)  # fmt: skip
    for j, g in enumerate(groups):
        if lines and g in lines:
            ax.hlines(lines[g], j - 0.45, j + 0.45, colors="k", linestyles="dashed")
    ax.set_xticks(x, groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(
        fontsize=8,
        ncols=min(len(names), 4),
        loc="upper center",
        bbox_to_anchor=(0.5, -0.1),
        frameon=False,
    )
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def parser() -> argparse.ArgumentParser:
    """The ``python -m train.results`` parser."""
    p = cli.parser(
        "python -m train.results",
        __doc__,
        task=None,
        attention=None,
        flags=("preset", "steps", "set", "no_progress", "restart"),
    )
    p.formatter_class = argparse.RawTextHelpFormatter
    p.add_argument("--tasks", default="listops", help="comma-separated tasks")
    p.add_argument(
        "--attentions",
        default="softmax,performer,flexformer_n",
        help="comma-separated mechanism names",
    )
    p.add_argument("--workdir", default="results")
    return p


def configs_from_argv(argv=None):
    """``(args, overrides, [config of each (task, attention) run])`` of `argv`."""
    args, overrides = cli.parse(parser(), argv, config_flags=False)
    runs = [
        run_config(t, a, args.steps, args.preset, overrides, not args.no_progress)
        for t in args.tasks.split(",")
        if t
        for a in args.attentions.split(",")
        if a
    ]
    return args, overrides, runs


def main(argv=None) -> list[dict[str, Any]]:
    args, overrides = cli.parse(parser(), argv, config_flags=False)
    logging.basicConfig(level=logging.WARNING)
    tasks = [t for t in args.tasks.split(",") if t]
    attentions = [a for a in args.attentions.split(",") if a]
    rows = run_all(
        tasks,
        attentions,
        steps=args.steps,
        preset=args.preset,
        workdir=args.workdir,
        overrides=overrides,
        progress=not args.no_progress,
        restart=args.restart,
    )
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    table = markdown_table(rows, steps=args.steps, preset=args.preset)
    (root / "results.md").write_text(table)
    (root / "results.json").write_text(json.dumps(rows, indent=2, default=str) + "\n")
    plot(rows, root / "results.png")
    print(table)
    print(f"wrote {root / 'results.md'}, {root / 'results.json'}, {root / 'results.png'}")
    return rows


if __name__ == "__main__":
    main()
