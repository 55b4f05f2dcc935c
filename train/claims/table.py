"""The equal-budget LRA-style table and the accuracy claims read off it.

Every arm (a mechanism, or a mechanism with an ablated option: `ARMS`) trains on the same
tasks with the same model, steps and seeds (`TASKS`). The power settings are
the defaults: `claims.MIN_SEEDS` = 5 seeds, test sets of 2000 examples, and budgets where
softmax learns each task (`softmax_learns`: on every seed at least `LEARNED`, and above
each linear baseline by a 95% interval wholly > 0):

* ListOps, expressions of 100-250 tokens (seq_len 256), 500 steps, 2000 test examples.
  At 3 seeds softmax's 31.9 +- 1.0% stood 8 to 16 points above performer, rfa and
  hedgehog (docs/claims.md, v1); hedgehog's spread (29.0 / 20.4 / 21.8) kept that
  interval wide at 3 seeds, and at its measured spreads 5 seeds narrow it to about +-6
  points, so the budget is kept. If the gate fails, the next budget to try is
  ``num_train_steps=1000`` (twice the compute).
* Pathfinder mini (12 x 12 images, 36 tokens) on 100 000 generated images (was 40 000)
  for 5000 steps (was 2000), 2000 test images. At 2000 steps softmax's seeds reached
  78.2 / 58.1 / 56.0%: it learns, but late, on one seed of three. More steps on more
  images (3.2 epochs, so no more passes over the data than before) is the budget. Checked
  on 2 of the 5 seeds (`train_run` at commit 4095046): softmax reached 99.7% and 98.6%
  test (seed 1 was still at 55.8% validation at step 2000, so the longer run is what
  makes it learn). At 8820581 all five seeds learn it: 98.65 / 98.50 / 97.55 / 96.15 /
  87.25% test (`python -m train.claims.runs --summary table`). The softmax runs come first,
  and if any seed stays below 70% the task's other arms are not trained (`run_table`) and
  its comparisons are not testable here.

Compute, from this table's own runs (wall seconds in their summary.json, runs two at a time
on this 2-core CPU): at 8820581 a ListOps run took 163 s on average (78-362 s, all 55 runs
of the 11 arms x 5 seeds) and a Pathfinder run of softmax 316 s (298-345 s, 5 runs) and
of the other arms 449 s (283-1204 s, 47 runs: all 50 but the three resumed from a
checkpoint, whose time counts only the steps after it), so `RUN_SECONDS` counts 180 s and
500 s, a margin above the means.
`compute_hours` turns that into estimates per claim (hours of runs; two at a time take half
the wall time).

Each (task, arm, seed) run lives in ``<workdir>/runs/<task>/<arm>/seed<s>`` and is keyed
by its full config and the code version (`train.claims.cache`): a finished run with the
same key is re-read, an interrupted one resumes, a stale one is moved aside and rerun.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import jax
import numpy as np

import linattn_jax as la
from train import configs
from train import trainer as trainer_lib
from train.bench import equivalence
from train.claims import (
    MIN_SEEDS,
    NOT_TESTABLE,
    Finding,
    Settings,
    claim,
    combine,
    mean_std,
    run_seconds,
)
from train.claims import cache as run_cache
from train.claims.stats import Rule
from train.results import grouped_bars

MECHANISMS = (
    "softmax",
    "performer",
    "rfa",
    "hedgehog",
    "flexformer_s",
    "flexformer_n",
    "nystromformer",
    "soft",
    "laplacian",
    "lara",
    "ra",
)
LINEAR = ("performer", "rfa", "hedgehog")
#: arm -> (mechanism, config changes): the table's mechanisms at their mini settings, and
#: the ablations of the mechanism claims and flexformer_n's kernel variants (one option
#: changed each; keys are config paths, e.g. ``attention_config.kernel``).
ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    **{m: (m, {}) for m in MECHANISMS},
    # LaplacianFormer: the same construction with a Gaussian kernel (needs the
    # mechanism option `kernel`; see laplacian_beats_soft)
    "laplacian_gaussian": ("laplacian", {"attention_config.kernel": "gaussian"}),
    # LARA: 16 proposals x 1 sample against 1 proposal x 16 samples (16 terms each)
    "lara_c16_s1": (
        "lara",
        {"attention_config.num_landmarks": 16, "attention_config.num_samples": 1},
    ),
    "lara_c1_s16": (
        "lara",
        {"attention_config.num_landmarks": 1, "attention_config.num_samples": 16},
    ),
    "lara_bh": ("lara", {"attention_config.mis": "bh"}),  # coupled weights: balance heuristic
    "lara_mixed": ("lara", {"attention_config.mixed": True}),  # the official "-mixed" proposals
    # flexformer_n's kernel variants on the table's tasks (docs/flexformer.md)
    **{
        f"flexformer_n_{name}": ("flexformer_n", change)
        for name, change in {
            "lr10": {"mechanism_lr_mult": 10.0},
            "f64": {"attention_config.num_features": 64},
            "f128": {"attention_config.num_features": 128},
            "f256": {"attention_config.num_features": 256},
            "orthogonal": {"attention_config.init_method": "orthogonal"},
            "init1.5": {"attention_config.init_scale": 1.5},
            "bandwidth": {"attention_config.learn_bandwidth": True},
            "raw": {"attention_config.qk_radius": None},
            "positive": {"attention_config.features": "positive"},
            # the paper's trigonometric pair (flexformer_n's default before the positive pair
            # won both tasks; docs/flexformer-ablations.md), at the storage it was measured
            # with, c = sqrt(d) = 4 (the default c = sqrt(H d) = 8 turns its weights negative)
            "trig": {"attention_config.features": "trig", "attention_config.freq_scale": 4.0},
            # the positive pair at c = 8, the default storage at the table's H = 4, d = 16
            # (omega~ at the init scale of a width-64 Dense), written out: arm of the
            # measurements that made it the default
            "positive_c8": {
                "attention_config.features": "positive",
                "attention_config.freq_scale": 8.0,
            },
            # the positive pair at the storage before: c = sqrt(d) = 4
            "positive_c4": {
                "attention_config.features": "positive",
                "attention_config.freq_scale": 4.0,
            },
        }.items()
    },
}
#: flexformer_n's kernel variants (arms of `ARMS`), each against flexformer_n
FLEXFORMER_VARIANTS = tuple(a for a in ARMS if a.startswith("flexformer_n_"))
#: task -> (preset, config changes); the budget is the same for every arm.
TASKS: dict[str, tuple[str, dict[str, Any]]] = {
    "listops": (
        "mini",
        {
            "data.min_length": 100,
            "data.max_length": 250,
            "data.seq_len": 256,
            "data.num_val": 1000,
            "data.num_test": 2000,
            "num_train_steps": 500,
        },
    ),
    # the training-equivalence benchmark's Pathfinder mini: 100k images, 5000 steps
    "pathfinder": equivalence.TASKS["pathfinder"],
}
#: wall seconds of one run per task at `TASKS` (measured means, rounded up; see above)
RUN_SECONDS = {"listops": 180.0, "pathfinder": 500.0}
#: softmax's test accuracy every seed must reach for the task to count as learned
LEARNED = {"listops": 0.25, "pathfinder": 0.70}
QUICK = {"num_train_steps": 4, "data.num_train": 64, "data.num_val": 32, "data.num_test": 32}
#: a win in accuracy (points: accuracies in [0, 1])
BEATS = Rule("greater", margin=0.01)
#: "about as good": within 2 points
LEVEL = Rule("equivalent", margin=0.02)


def compute_hours(arms: int, tasks=tuple(TASKS), seeds: int = MIN_SEEDS) -> float:
    """Estimated hours of wall time (summed) of `arms` arms on `tasks` (`RUN_SECONDS`)."""
    return arms * seeds * sum(RUN_SECONDS[t] for t in tasks) / 3600


def _set(config, key: str, value) -> None:
    *parents, leaf = key.split(".")
    node = config
    for p in parents:
        node = node[p]
    with node.ignore_type():
        node[leaf] = value


def task_config(task: str, arm: str, seed: int, quick: bool = False):
    """The training config of one table run (`arm`: a key of `ARMS`)."""
    if arm not in ARMS:
        raise ValueError(f"table: arm must be one of {tuple(ARMS)}, got {arm!r}")
    preset, changes = TASKS[task]
    mechanism, options = ARMS[arm]
    config = configs.get_config(task, preset)
    configs.set_attention(config, mechanism)
    for key, value in {**changes, **options, **(QUICK if quick else {}), "seed": seed}.items():
        _set(config, key, value)
    config.progress_bar = False
    return config


def budget(config) -> str:
    """The attention budget of a run, e.g. ``"64 features"``, ``"16 landmarks"``,
    ``"36 proposals x 1 sample"`` (proposals and landmarks capped at the tokens)."""
    name = config.attention
    mech = la.get(name)
    values = {}
    for fn in (mech.init_fn, mech.attention_fn):
        for k, p in inspect.signature(fn).parameters.items():
            if p.default is not inspect.Parameter.empty:
                values.setdefault(k, p.default)
    values.update(mech.defaults or {})
    values.update(config.attention_config.to_dict())
    tokens = _tokens(config)
    if name in ("lara",):
        c = min(values["num_landmarks"], tokens)
        return f"{c} proposals x {values['num_samples']} sample(s)"
    if name == "ra":
        return f"{values['num_samples']} sample(s) per query (quadratic)"
    if "num_landmarks" in values:
        return f"{min(values['num_landmarks'], tokens)} landmarks"
    if "num_features" in values:
        return f"{values['num_features']} features"
    if "feature_dim" in values:
        return f"{values['feature_dim']} features"
    return "exact (quadratic)" if name == "softmax" else "-"


def _tokens(config) -> int:
    if config.task == "pathfinder":
        size = config.data.get("image_size") or 12
        return (size // int(config.model.get("patch_size") or 1)) ** 2
    return int(config.data.seq_len)


def table_tasks(settings: Settings) -> tuple[str, ...]:
    """The tasks of the table under `settings` (``settings.tasks``, default all `TASKS`)."""
    tasks = tuple(TASKS) if settings.tasks is None else tuple(settings.tasks)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"tasks must be a non-empty subset of {tuple(TASKS)}, got {tasks}")
    return tasks


def train_run(settings: Settings, task: str, arm: str, seed: int, log=print) -> dict:
    """The summary of one table run: re-read when finished under the same key (config and
    code version), else trained (resumed from its checkpoints when its key matches)."""
    config = task_config(task, arm, seed, settings.quick)
    path = table_dir(settings, task, arm, seed)
    return run_cache.trained(config, path, log=log, copy=settings.kept(path))


def run_table(settings: Settings, mechanisms=None, tasks=None, summaries=None, log=print):
    """``{task: {arm: [test accuracy per seed]}}`` (default: every `MECHANISMS` on the
    tasks of `table_tasks`), training what is not finished. softmax runs first: on a task
    it does not learn on every seed (`LEARNED`) no other arm is trained (its runs are
    still read when finished). `summaries`, a dict if given, receives each run's summary
    by its directory."""
    out: dict[str, dict[str, list[float]]] = {}
    for task in tasks or table_tasks(settings):
        out[task] = {}
        names = list(mechanisms or MECHANISMS)
        gate = "softmax" in names
        for name in sorted(names, key=lambda n: n != "softmax"):
            accs = []
            for seed in range(settings.seeds):
                if gate and name != "softmax" and not _softmax_ok(out[task], task):
                    summary = _read_finished(settings, task, name, seed)
                    if summary is None:
                        continue
                else:
                    summary = train_run(settings, task, name, seed, log=log)
                if summaries is not None:
                    summaries[table_dir(settings, task, name, seed)] = summary
                accs.append(float(summary["test"]["accuracy"]))
            if accs:
                out[task][name] = accs
    return out


def _softmax_ok(row: dict, task: str) -> bool:
    return bool(row.get("softmax")) and min(row["softmax"]) >= LEARNED[task]


def _read_finished(settings, task, arm, seed) -> dict | None:
    config = task_config(task, arm, seed, settings.quick)
    path = table_dir(settings, task, arm, seed)
    return run_cache.finished_run(config, path, copy=settings.kept(path))


def table_dir(settings: Settings, task: str, name: str, seed: int) -> Path:
    """The directory of a table run (`train_run`) under the claims workdir."""
    return Path(settings.workdir) / "runs" / task / name / f"seed{seed}"


def softmax_learns(table: dict, task: str) -> tuple[bool, str]:
    """Is `task` learned at this budget: softmax at least `LEARNED` on every seed, and
    above each linear baseline that ran (`BEATS` reproduced)? With the reason."""
    row = table.get(task) or {}
    if "softmax" not in row:
        return False, "softmax not run"
    if min(row["softmax"]) < LEARNED[task]:
        seeds = " / ".join(f"{100 * a:.1f}" for a in row["softmax"])
        return False, f"softmax below {100 * LEARNED[task]:.0f}% on a seed ({seeds})"
    behind = [
        b for b in LINEAR if b in row and BEATS.decide(row["softmax"], row[b])[0] != "reproduced"
    ]
    if behind:
        return False, f"softmax not clearly above {', '.join(behind)}"
    return True, "learned"


def _cells(table: dict, task: str) -> dict[str, tuple[float, float]]:
    return {name: mean_std(accs) for name, accs in table[task].items()}


def not_run(done, tasks=TASKS) -> list[str]:
    """``"<task>: not run yet"`` for each task of `tasks` (the claim's own) not in `done`."""
    return [f"{t}: not run yet" for t in tasks if t not in done]


def _fmt(ms: tuple[float, float]) -> str:
    return f"{100 * ms[0]:.1f} +- {100 * ms[1]:.1f}"


def markdown_table(table: dict, budgets: dict[str, dict[str, str]] | None = None) -> str:
    """The table as markdown: a row per arm, a column per task, each cell the test accuracy
    (%) as mean +- sample std, the seeds' values and (with `budgets`, ``{task: {arm:
    text}}``) the attention budget; the best mean of a column in bold."""
    tasks = list(table)
    names = list(dict.fromkeys(n for t in tasks for n in table[t]))
    best = {t: max(table[t], key=lambda n: mean_std(table[t][n])[0]) for t in tasks}
    lines = ["| attention | " + " | ".join(f"{t} test acc (%)" for t in tasks) + " |"]
    lines.append("|---" * (len(tasks) + 1) + "|")
    for n in names:
        cells = []
        for t in tasks:
            if n not in table[t]:
                cells.append("")
                continue
            text = _fmt(mean_std(table[t][n]))
            text = f"**{text}**" if n == best[t] else text
            seeds = " / ".join(f"{100 * a:.1f}" for a in table[t][n])
            extra = f"; {budgets[t][n]}" if budgets and n in budgets.get(t, {}) else ""
            cells.append(f"{text} ({seeds}{extra})")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


@claim(
    "table.equal_budget",
    paper="Equal budget",
    statement="Every mechanism at one budget on LRA-style tasks (the table the seeds' claims "
    "about LRA accuracy are read from).",
    experiment="Test accuracy (%, mean +- sample std over seeds) after the same steps, model "
    "(2 layers, width 64, 4 heads) and data: ListOps with 100-250-token expressions (seq_len "
    "256, 500 steps, 2000 test examples) and generated Pathfinder mini (100 000 training "
    "images, 5000 steps, 2000 test images); each row's attention budget beside it.",
    rule="Not a claim: the verdict says whether softmax learns each task at this budget "
    f"(every seed >= {LEARNED} test accuracy, and above each linear baseline by a 95% Welch "
    "interval wholly > 0): reproduced when on every task, partly when on some, not testable "
    "here when on none. The comparisons skip a task softmax does not learn.",
    kind="train",
    compute=f"about {compute_hours(len(MECHANISMS)):.1f} h of runs (11 mechanisms x 5 seeds: "
    f"{compute_hours(len(MECHANISMS), ('listops',)):.1f} h ListOps, "
    f"{compute_hours(len(MECHANISMS), ('pathfinder',)):.1f} h Pathfinder), run two at a time",
)
def equal_budget(settings: Settings) -> Finding:
    summaries: dict[Path, dict] = {}
    table = run_table(settings, summaries=summaries)
    lines = []
    for task in table:
        cells = _cells(table, task)
        best = max(cells, key=lambda n: cells[n][0])
        lines.append(
            f"{task}: " + ", ".join(f"{n} {_fmt(c)}" for n, c in cells.items()) + f" (best {best})"
        )
    missing = [t for t in TASKS if t not in table]
    if missing:
        lines.append(f"not run yet: {', '.join(missing)}")
    learns = {t: softmax_learns(table, t) for t in table}
    ok = [v[0] for v in learns.values()]
    verdict = "reproduced" if all(ok) else "partly" if any(ok) else NOT_TESTABLE
    why = (
        "This row is the table itself; its verdict says whether softmax learns each task at "
        f"this budget: { ({t: r for t, (_, r) in learns.items()}) }."
    )
    train_runs = run_seconds(settings, summaries)
    why += f" Its training runs took {sum(train_runs.values()) / 3600:.1f} h of wall time."
    plot = Path(settings.findings) / "table.equal_budget.png"
    plot.parent.mkdir(parents=True, exist_ok=True)
    bars = {(t, n): tuple(100 * x for x in mean_std(a)) for t in table for n, a in table[t].items()}
    title = f"equal budget: test accuracy, mean +- std over {settings.seeds} seeds"
    chance = {"pathfinder": 50.0} if "pathfinder" in table else None  # dashed: chance
    grouped_bars(bars, plot, title=title, lines=chance)
    budgets = {
        t: {n: budget(task_config(t, n, 0, settings.quick)) for n in table[t]} for t in table
    }
    data = {
        "table": table,
        "budgets": budgets,
        "markdown": markdown_table(table, budgets),
        "plot": plot.name,
        "train_runs": train_runs,
    }
    return Finding("; ".join(lines), verdict, why, data)


def compare(
    table: dict, name: str, others, rule: Rule = BEATS, tasks=TASKS
) -> tuple[str, str, dict]:
    """``(numbers, verdict, per)``: `name` against each arm of `others` by `rule` on each
    task softmax learns (`softmax_learns`; the others are not testable), combined
    (`train.claims.stats.combine`); a task of `tasks` (the claim's own) missing from `table`
    is named as not run yet. `per`: ``{"task|other": verdict}``."""
    parts, per = [], {}
    for task in table:
        learned, reason = softmax_learns(table, task)
        row = table[task]
        if not learned:
            parts.append(f"{task}: not testable ({reason})")
            continue
        if name not in row or any(o not in row for o in others):
            gone = [n for n in (name, *others) if n not in row]
            parts.append(f"{task}: not testable ({', '.join(gone)} not run)")
            continue
        for o in others:
            verdict, st = rule.decide(row[name], row[o])
            per[f"{task}|{o}"] = verdict
            parts.append(
                f"{task}: {name} {_fmt(mean_std(row[name]))} vs {o} {_fmt(mean_std(row[o]))}, "
                f"difference {rule.summary(st)} -> {verdict}"
            )
    parts += not_run(table, tasks)
    return "; ".join(parts), combine(per.values()) if per else NOT_TESTABLE, per


def compare_runs(
    settings: Settings, mechanisms, name: str, others, rule: Rule = BEATS, tasks=None
) -> tuple[str, str, dict]:
    """``(numbers, verdict, data)``: `compare` on the runs of `mechanisms` (`run_table` on
    `tasks`, default the table's); `data` has each comparison's verdict (``per``) and the
    runs' wall seconds (``train_runs``, counted in the report's compute)."""
    summaries: dict[Path, dict] = {}
    runs = run_table(settings, mechanisms=mechanisms, tasks=tasks, summaries=summaries)
    numbers, verdict, per = compare(runs, name, others, rule, tasks or TASKS)
    return numbers, verdict, {"per": per, "train_runs": run_seconds(settings, summaries)}


def _table_mechanisms(arms) -> tuple[str, ...]:
    """A table claim's mechanisms: softmax (the task's check), the linear baselines, `arms`."""
    return ("softmax", *LINEAR, *arms)


def _table(settings: Settings, arms) -> dict:
    return run_table(settings, mechanisms=_table_mechanisms(arms))


@claim(
    "flexformer.beats_linear",
    paper="Flexformer",
    statement="Flexformer beats the linear-attention baselines (performer, rfa, hedgehog) at "
    "equal budget on the LRA average.",
    experiment="The equal-budget table (`table.equal_budget`): per seed, flexformer_n's test "
    "accuracy averaged over the tasks softmax learns, against the same average of "
    "performer, rfa and hedgehog.",
    rule="Each baseline: "
    + BEATS.text("flexformer_n's LRA average", "the baseline's")
    + " Combined over the three baselines: all reproduced -> reproduced, some -> partly.",
    kind="train",
    compute="reads the table (no runs of its own)",
)
def flexformer_beats_linear(settings: Settings) -> Finding:
    table = _table(settings, ("flexformer_n",))
    tasks = [t for t in table if softmax_learns(table, t)[0]]
    names = ("flexformer_n", *LINEAR)
    if not tasks or any(n not in table[t] for t in tasks for n in names):
        skipped = {t: softmax_learns(table, t)[1] for t in table}
        return Finding(f"not testable: {skipped}", NOT_TESTABLE, "No task to average.", {})
    n_seeds = min(len(table[t][n]) for t in tasks for n in names)
    avg = {n: [float(np.mean([table[t][n][s] for t in tasks])) for s in range(n_seeds)]
           for n in names}  # fmt: skip
    per, parts = {}, []
    for o in LINEAR:
        per[o], st = BEATS.decide(avg["flexformer_n"], avg[o])
        parts.append(f"vs {o} {_fmt(mean_std(avg[o]))}: {BEATS.summary(st)} -> {per[o]}")
    numbers = (
        f"LRA average over {', '.join(tasks)} ({n_seeds} seeds): flexformer_n "
        f"{_fmt(mean_std(avg['flexformer_n']))}; " + "; ".join(parts)
    )
    growth = {t: frequency_growth(settings, t) for t in tasks}
    why = (
        "The paper compares LRA averages. With q and k normalised (qk_radius=1) the kernel's "
        "sharpness comes from its learned temperature and the scale of the learned frequencies "
        "(docs/flexformer.md); the mean row norm of flexformer_n's frequencies after training "
        "over their init (seed 0; None: no checkpoint): "
        + ", ".join(f"{t} {'None' if g is None else f'{g:.3f}'}" for t, g in growth.items())
    )
    data = {"average": avg, "per": per, "frequency_growth": growth}
    return Finding(numbers, combine(per.values()), why, data)


def frequency_growth(settings: Settings, task: str, name="flexformer_n", seed=0) -> float | None:
    """Mean row norm of the table run's learned frequencies (every ``omega*`` parameter) at
    its last checkpoint over the same at init; None when the run has no checkpoint."""
    config = task_config(task, name, seed, settings.quick)
    try:
        trainer, state, _ = trainer_lib.restore_run(
            config, table_dir(settings, task, name, seed), prefer="latest"
        )
    except FileNotFoundError:
        return None

    def norm(params):
        rows = [
            np.linalg.norm(np.asarray(x), axis=-1).mean()
            for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
            if path[-1].key.startswith("omega")
        ]
        return float(np.mean(rows))

    return norm(state.params) / norm(trainer.init_state().params)


def gaussian_option() -> str:
    """'' when `laplacian` takes ``kernel="gaussian"``, else why not."""
    try:
        la.get("laplacian").bind(kernel="gaussian")
    except (TypeError, ValueError) as e:
        return f"laplacian has no kernel='gaussian' option ({type(e).__name__}: {e})"
    return ""


@claim(
    "laplacian.beats_soft",
    paper="LaplacianFormer",
    statement="The Laplace kernel beats the Gaussian kernel in the same Nystrom construction.",
    experiment="Isolated ablation on the table's tasks: laplacian against laplacian with "
    "kernel='gaussian' (same landmarks, local branch, injective normalisation and inverse; "
    "only the kernel differs).",
    rule="Each task: "
    + BEATS.text("laplacian", "laplacian_gaussian")
    + " Combined over tasks: all reproduced -> reproduced, some -> partly.",
    kind="train",
    compute=f"about {compute_hours(1):.1f} h (the Gaussian arm; laplacian is in the table)",
)
def laplacian_beats_soft(settings: Settings) -> Finding:
    missing = gaussian_option()
    if missing:
        return Finding(
            f"not testable: {missing}",
            NOT_TESTABLE,
            "The claim is about the kernel alone, so both arms must share the construction; "
            "`soft` differs in its landmarks, normalisation, scaling and local branch. It "
            "needs a mechanism option laplacian(kernel='gaussian').",
        )
    arms = _table_mechanisms(("laplacian", "laplacian_gaussian"))
    numbers, verdict, data = compare_runs(settings, arms, "laplacian", ["laplacian_gaussian"])
    return Finding(numbers, verdict, "Only the kernel differs between the arms.", data)


@claim(
    "lara.trains_better",
    paper="RA / LARA",
    statement="LARA outperforms performer on every LRA task at linear complexity.",
    experiment="The equal-budget table: lara against performer on each task.",
    rule="Each task: "
    + BEATS.text("lara", "performer")
    + " Combined over tasks: all reproduced -> reproduced, some -> partly.",
    kind="train",
    compute="reads the table (no runs of its own)",
)
def lara_trains_better(settings: Settings) -> Finding:
    numbers, verdict, per = compare(_table(settings, ("lara",)), "lara", ["performer"])
    why = "Budgets beside each row of the table (lara's proposals are capped at the tokens)."
    return Finding(numbers, verdict, why, {"per": per})
