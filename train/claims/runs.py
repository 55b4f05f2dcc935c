"""``python -m train.claims.runs``: the training claims' runs, listed or trained N at a time.

python -m train.claims.runs --list table lm          # each run's state, the compute left
python -m train.claims.runs --jobs 2 table           # train what is not finished, 2 at a time
python -m train.claims.runs --jobs 2 lm listops:softmax:0 pathfinder:lara:3
python -m train.claims.runs --seeds 3 --summary flexformer   # means, intervals, diagnostics

A run is ``task:arm:seed`` (task ``listops`` / ``pathfinder``: a run of the equal-budget
table, `train.claims.table.train_run`; ``lm``: a byte-LM run of ``flexformer.lm``,
`train.claims.ablations.lm_run`; ``distill`` / ``transfer``: a run of
``flexformer.distillation`` / ``flexformer.transfer``, `train.claims.distillation`, whose
arm ``teacher`` is the softmax teacher of that seed) or a group: ``table`` (every mechanism
of the table on both tasks), ``ablations`` (the extra arms of the mechanism claims:
laplacian_gaussian on both tasks, LARA's ablation arms on ListOps), ``lm``, ``flexformer``
(the kernel-variant ablation: flexformer_n and its variants `table.FLEXFORMER_VARIANTS` on both
tasks; a 3-seed screen is ``--seeds 3``), ``distill`` and ``transfer`` (their
teachers first). A group is ordered for partial progress: per task softmax's seeds first
(the claims train no other arm on a task softmax does not learn; this queue does, so run
softmax first and check it), then seed by seed over the arms. The runs are the claims'
own (same config, directory and key), so `python -m train.claims` reads them afterwards
without training.

Each pending run is trained in a subprocess (``--one``), so that ``--jobs 2`` keeps two
processes busy on a 2-core machine; runs that read others' results wait for them (`phase`:
teachers, then distillations, then transfers). States (``--list``): finished (a summary under the
current key), started (the current key, no summary: resumed from its checkpoints),
stale (another key: moved aside and retrained), pending (no directory).

``--summary`` prints, per task and arm, the finished runs' result (`result`: test
accuracy, bits per byte for lm, the accuracy drop of a transfer) as mean +- sample std with
the seeds' values, the 95% Welch interval of the difference to a reference arm
(``--against``; default an ablation arm's own mechanism, else softmax) and the mean of the
kernel diagnostics' end values (`kernel/...`) where the runs log them. ``--code VERSION``
reads (``--list``, ``--summary``) the runs of an earlier code version instead, as the ledger
keeps them: e.g. ``--code d96b4e34e15a860c`` for the kernel-variant ablation's Pathfinder runs.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from train.claims import MIN_SEEDS, Settings, ablations, distillation, table
from train.claims import cache as run_cache
from train.claims.stats import interval

STATES = ("finished", "started", "stale", "pending")


class Run(NamedTuple):
    task: str
    arm: str
    seed: int

    def __str__(self) -> str:
        return f"{self.task}:{self.arm}:{self.seed}"


def _grid(task: str, arms, seeds: int, lead: str = "softmax") -> list[Run]:
    """`lead`'s seeds first (when among `arms`), then seed by seed over the other arms."""
    first = [Run(task, lead, s) for s in range(seeds)] if lead in arms else []
    rest = [Run(task, a, s) for s in range(seeds) for a in arms if a != lead]
    return first + rest


def _arms(task: str):
    """The arms of a task: the table's arms, the byte LM's, or a distillation kind's
    (`distillation.QUEUE`, with its ``teacher``)."""
    if task in table.TASKS:
        return tuple(table.ARMS)
    if task == "lm":
        return ablations.LM_ARMS
    return distillation.QUEUE[task][1]


TASKS = (*table.TASKS, "lm", *distillation.QUEUE)


def groups(seeds: int = MIN_SEEDS) -> dict[str, list[Run]]:
    lara_arms = ("lara_c16_s1", "lara_c1_s16", "lara_bh", "lara_mixed")
    return {
        "table": [r for t in table.TASKS for r in _grid(t, table.MECHANISMS, seeds)],
        "ablations": [r for t in table.TASKS for r in _grid(t, ("laplacian_gaussian",), seeds)]
        + [r for t in ablations.ABLATION_TASKS for r in _grid(t, lara_arms, seeds)],
        "lm": _grid("lm", ablations.LM_ARMS, seeds),
        "flexformer": [
            r
            for t in table.TASKS
            for r in _grid(t, ("flexformer_n", *table.FLEXFORMER_VARIANTS), seeds)
        ],
        "distill": _grid("distill", distillation.QUEUE["distill"][1], seeds, "teacher"),
        # a transfer also distils its student on the source task: that task's teachers first
        "transfer": [Run("distill", "teacher", s) for s in range(seeds)]
        + _grid("transfer", distillation.QUEUE["transfer"][1], seeds, "teacher"),
    }


def parse(item: str) -> Run:
    """``task:arm:seed`` -> `Run`; ValueError naming the item when it is not one."""
    parts = item.split(":")
    if (
        len(parts) != 3
        or parts[0] not in TASKS
        or parts[1] not in _arms(parts[0])
        or not parts[2].isdigit()
    ):
        arms = "; ".join(f"{t}: {sorted(_arms(t))}" for t in ("listops", "lm", *distillation.QUEUE))
        raise ValueError(
            f"run {item!r}: expected task:arm:seed with task in {list(TASKS)}, an arm of that "
            f"task (the table's tasks share theirs; {arms}) and a seed >= 0, or a group "
            f"{list(groups(1))}"
        )
    return Run(parts[0], parts[1], int(parts[2]))


def expand(names, seeds: int = MIN_SEEDS) -> list[Run]:
    """Groups and items -> runs, in order, each once."""
    g = groups(seeds)
    out: list[Run] = []
    for name in names:
        for run in g[name] if name in g else [parse(name)]:
            if run not in out:
                out.append(run)
    return out


def config_and_dir(settings: Settings, run: Run):
    if run.task == "lm":
        return (ablations.lm_config(run.arm, run.seed, settings.quick),
                ablations.lm_dir(settings, run.arm, run.seed))  # fmt: skip
    return (table.task_config(run.task, run.arm, run.seed, settings.quick),
            table.table_dir(settings, run.task, run.arm, run.seed))  # fmt: skip


def state(settings: Settings, run: Run, code: str | None = None) -> tuple[str, dict | None]:
    """One of `STATES`, and the summary of a finished run (else None). `code`: read the run
    as trained by that code version (a run key's ``"code"``, `run_cache.code_version`)
    instead of the current one: the ledger's results of earlier code (table and lm runs)."""
    if code is not None and run.task in distillation.QUEUE:
        raise ValueError(f"--code reads table and lm runs only, not {run}")
    if run.task in distillation.QUEUE:
        spec = distillation.queued_run(settings, *run)
        key, path, _ = spec
        summary = distillation.finished_queued(run.task, run.arm, spec, settings.kept(path))
    else:
        config, path = config_and_dir(settings, run)
        key = run_cache.run_key(config)  # hashes the code it runs: computed once
        key = key if code is None else {**key, "code": code}
        summary = run_cache.finished(
            path, key, int(config.num_train_steps), copy=settings.kept(path)
        )
    if summary is not None:
        return "finished", summary
    if not path.exists():
        return "pending", None
    return ("started" if run_cache.read_key(path) == key else "stale"), None


def phase(run: Run) -> int:
    """Runs of a later phase start after every run of the earlier ones has ended: the
    distillations (1) read their teachers (0), the transfers (2) the distillations' maps."""
    if run.arm == "teacher" or run.task not in distillation.QUEUE:
        return 0
    return 1 if run.task == "distill" else 2


def estimate_seconds(run: Run) -> float:
    """The estimated wall time of `run` (`table.RUN_SECONDS`, `ablations.LM_RUN_SECONDS`,
    `distillation.RUN_SECONDS`)."""
    if run.task in distillation.QUEUE:
        return distillation.RUN_SECONDS
    return ablations.LM_RUN_SECONDS if run.task == "lm" else table.RUN_SECONDS[run.task]


def train(settings: Settings, run: Run) -> dict:
    """Trains (or re-reads) `run` in this process, exactly as its claim does (`table.train_run`,
    `ablations.lm_run`, `distillation.train_queued`: the same config and directory)."""
    if run.task in distillation.QUEUE:
        return distillation.train_queued(settings, *run)
    config, path = config_and_dir(settings, run)
    return run_cache.trained(config, path, copy=settings.kept(path))


def result(run: Run, summary: dict) -> tuple[str, float]:
    """``(name, value)`` of a finished run: test accuracy (the table's tasks, teachers and
    distilled students), test bits per byte (lm) or a transfer's accuracy drop."""
    if run.task in distillation.QUEUE:
        return distillation.queued_result(run.task, run.arm, summary)
    name = "bits_per_byte" if run.task == "lm" else "accuracy"
    return name, float(summary["test"][name])


def _result(run: Run, summary: dict | None) -> str:
    """`` accuracy 0.5120`` (see `result`) of a finished run's summary; '' for None."""
    if summary is None:
        return ""
    name, value = result(run, summary)
    return f" {name} {value:.4f}"


def _reference(task: str, arm: str, against: str | None = None) -> str:
    """The arm `arm` is compared with: `against` when given, else an ablation arm's own
    mechanism, else softmax."""
    if against is not None:
        return against
    if task in table.TASKS and table.ARMS[arm][0] != arm:
        return table.ARMS[arm][0]
    return "softmax"


def summary_lines(runs, summaries: dict, against: str | None = None) -> list[str]:
    """`--summary`'s lines: per (task, arm) of `runs` with finished `summaries`, the test
    result as mean +- sample std (and the seeds' values), the 95% Welch interval of the
    difference to `_reference` (when both have >= 2 seeds) and the mean end values of the
    kernel diagnostics."""
    values, kernel = collections.defaultdict(dict), collections.defaultdict(list)
    metric = {}
    for r in runs:
        s = summaries.get(r)
        if s is not None:
            metric[r.task], values[r.task, r.arm][r.seed] = result(r, s)
            if s.get("kernel"):
                kernel[r.task, r.arm].append(s["kernel"]["end"])
    lines = []
    for (task, arm), by_seed in values.items():
        v = [by_seed[k] for k in sorted(by_seed)]
        scale, n = (1.0, 3) if task == "lm" else (100.0, 2)  # accuracies, drops in %
        std = f" +- {scale * np.std(v, ddof=1):.{n}f}" if len(v) > 1 else ""
        seeds = ", ".join(f"{k}: {scale * by_seed[k]:.{n}f}" for k in sorted(by_seed))
        mean = f"{metric[task]} {scale * np.mean(v):.{n}f}{std} ({seeds})"
        line = f"{task:10s} {arm:24s} n={len(v)} {mean}"
        other = _reference(task, arm, against)
        ref = values.get((task, other))
        if ref is not None and arm != other and len(v) > 1 and len(ref) > 1:
            d, lo, hi = (scale * x for x in interval(v, list(ref.values()), "welch"))
            line += f"; - {other} {d:+.{n}f} [{lo:+.{n}f}, {hi:+.{n}f}]"
        if kernel[task, arm]:
            ends = {
                k: np.mean([e[k] for e in kernel[task, arm] if k in e])
                for k in kernel[task, arm][0]
            }
            line += "; end " + ", ".join(
                f"{k.split('/')[-1]} {x:.4g}" for k, x in sorted(ends.items())
            )
        lines.append(line)
    return lines


def _spawn(run: Run, settings: Settings) -> int:
    cmd = [sys.executable, "-m", "train.claims.runs", "--one", str(run)]
    cmd += ["--workdir", str(settings.workdir)] + (["--quick"] if settings.quick else [])
    return subprocess.run(cmd, check=False).returncode


def main(argv=None) -> dict[str, str]:
    p = argparse.ArgumentParser(prog="python -m train.claims.runs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("runs", nargs="*", help="groups (table, ablations, lm) or task:arm:seed")
    p.add_argument("--list", action="store_true", help="print each run's state and exit")
    p.add_argument("--summary", action="store_true",
                   help="print the finished runs' results per task and arm, and exit")  # fmt: skip
    p.add_argument("--against", default=None,
                   help="--summary: compare every arm with this one (default: an ablation "
                   "arm's mechanism, else softmax)")  # fmt: skip
    p.add_argument("--code", default=None,
                   help="--list / --summary: read the runs of this code version (a run key's "
                   "'code') instead of the current one's")  # fmt: skip
    p.add_argument("--jobs", type=int, default=2, help="runs trained at once (default 2)")
    p.add_argument("--seeds", type=int, default=MIN_SEEDS, help="seeds of a group")
    p.add_argument("--workdir", default="workdir/claims")
    p.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    settings = Settings(seeds=args.seeds, quick=args.quick, workdir=Path(args.workdir))
    if args.one is not None:
        run = parse(args.one)
        print(f"{args.one}:{_result(run, train(settings, run))}", flush=True)
        return {args.one: "finished"}
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    if not args.runs:
        p.error("give runs: a group (table, ablations, lm) or task:arm:seed")
    if args.code is not None and not (args.list or args.summary):
        p.error("--code reads runs (--list, --summary); training runs the current code")
    try:
        runs = expand(args.runs, args.seeds)
        states, summaries = {}, {}
        for r in runs:
            states[r], summaries[r] = state(settings, r, args.code)
    except ValueError as e:
        p.error(str(e))
    left = [r for r in runs if states[r] != "finished"]
    hours = sum(estimate_seconds(r) for r in left) / 3600
    counts = ", ".join(f"{s} {sum(v == s for v in states.values())}" for s in STATES)
    print(f"{len(runs)} runs: {counts}; left about {hours:.1f} h of runs "
          f"({hours / args.jobs:.1f} h at {args.jobs} at a time)", flush=True)  # fmt: skip
    if args.list:
        for r in runs:
            print(f"  {r!s:40s} {states[r]}{_result(r, summaries[r])}")
        return {str(r): s for r, s in states.items()}
    if args.summary:
        print("\n".join(summary_lines(runs, summaries, args.against)))
        return {str(r): s for r, s in states.items()}
    done = {str(r): "finished" for r in runs if states[r] == "finished"}
    t0 = time.perf_counter()
    for ph in sorted({phase(r) for r in left}):
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = {pool.submit(_spawn, r, settings): r for r in left if phase(r) == ph}
            for f in concurrent.futures.as_completed(futures):
                r, rc = futures[f], f.result()
                done[str(r)] = "finished" if rc == 0 else f"failed (exit {rc})"
                print(f"[runs] {r}: {done[str(r)]} ({time.perf_counter() - t0:.0f} s in)",
                      flush=True)  # fmt: skip
    return done


if __name__ == "__main__":
    main()
