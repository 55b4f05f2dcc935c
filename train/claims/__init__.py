"""What the seed papers claim, tested at small scale: ``python -m train.claims``.

Each claim is one small experiment (`Claim`), registered under a key such as
``flexformer.init_rate``. Running a claim gives a `Finding`: the numbers (markdown), a
verdict from `VERDICTS` and why, i.e. what the verdict rests on and what would change it.
Findings are kept as JSON in ``<findings>/<key>.json`` (by default ``docs/claims/``, tracked
by git, so findings from different runs of it merge and a fresh clone rebuilds the report) with
the settings, the commit and the time they took, so the report can be built in parts
(``--only``, ``--kind``) and merged; a kept finding is reused while its settings match.
Training runs go under ``<workdir>`` (not tracked); each finished run's key and summary are
kept in the ledger, ``<findings>/ledger/`` (tracked, `Settings.kept`), so a fresh clone
reads what earlier runs trained. `report` writes the markdown of
docs/claims.md from whatever findings are kept; a claim not run yet is listed with the
command that runs it. The verdicts are computed by the experiments, never typed in.

Claims are of two kinds: ``"cheap"`` (estimator statistics, solvers, compiled memory:
seconds to a few minutes) and ``"train"`` (training runs on the mini tasks, `Settings.seeds`
seeds each, >= 5 by default). Each claim carries its `rule` (printed before its numbers;
comparisons are decided by `train.claims.stats` from a 95% interval of the difference), its
`command` and an estimate of its `compute`. A finding is current when it was made under the
same settings and code version (`train.claims.cache.code_version`); the report shows an
older one as pending, with its old verdict. Training runs are cached by their full config
and the code version (`train.claims.cache`), so stale runs rerun and interrupted ones
resume.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from train.claims.stats import (  # noqa: F401 -- the verdicts, re-exported
    INCONCLUSIVE,
    NOT_REPRODUCED,
    NOT_TESTABLE,
    PARTLY,
    REPRODUCED,
    VERDICTS,
    Rule,
    combine,
)

KINDS = ("cheap", "train")
PAPERS = ("Flexformer", "LaplacianFormer", "RA / LARA", "Equal budget")
COMMAND = "python -m train.claims"


#: the fewest seeds of a claim that compares accuracies
MIN_SEEDS = 5


@dataclasses.dataclass(frozen=True)
class Settings:
    """Run settings; a cached finding is reused only under equal `key` fields.

    Attributes:
      seeds: seeds per training run (and per statistical repeat where a claim uses them);
        >= `MIN_SEEDS` by default (the CLI warns below it).
      quick: tiny sizes (for the tests: the numbers then mean nothing).
      workdir: the training runs (large, not tracked).
      findings: the findings, ``<key>.json`` each (small, tracked by git by default).
      tasks: the equal-budget table's tasks the training claims use (None: all of
        `train.claims.table.TASKS`), so a table can be reported one task at a time.
    """

    seeds: int = MIN_SEEDS
    quick: bool = False
    workdir: Path = Path("workdir/claims")
    findings: Path = Path("docs/claims")
    tasks: tuple[str, ...] | None = None

    def key(self, kind: str | None = None) -> dict[str, Any]:
        """The fields a finding of a claim of `kind` depends on (`tasks` only for training
        claims, which read the table)."""
        key: dict[str, Any] = {"seeds": self.seeds, "quick": self.quick}
        if self.tasks is not None and kind in (None, "train"):
            key["tasks"] = list(self.tasks)
        return key

    def kept(self, run_dir) -> Path | None:
        """Where the ledger keeps the run in `run_dir` (a directory under `workdir`): its key
        and summary under ``<findings>/ledger/`` at the same relative path
        (`train.claims.cache.keep`), tracked by git, so that a fresh clone reads the runs
        that earlier invocations finished instead of training them again (a run is read only
        under its key: the same config and code version). None with `quick`: tiny runs are
        never kept."""
        if self.quick:
            return None
        return Path(self.findings) / "ledger" / Path(run_dir).relative_to(self.workdir)


@dataclasses.dataclass
class Finding:
    """One claim's result: `numbers` (markdown), `verdict` (one of `VERDICTS`), `why`."""

    numbers: str
    verdict: str
    why: str
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"Finding: verdict must be one of {VERDICTS}, got {self.verdict!r}")


@dataclasses.dataclass(frozen=True)
class Claim:
    """A registered claim: what the paper states, the experiment, the `rule` that decides
    it (stated before its numbers), the `command` that runs it and its `compute` (an
    estimate at the default settings, from the timings named in the text)."""

    key: str
    paper: str
    statement: str
    experiment: str
    fn: Callable[[Settings], Finding]
    kind: str = "cheap"
    rule: str = ""
    command: str = ""
    compute: str = ""


CLAIMS: dict[str, Claim] = {}


def claim(
    key: str,
    *,
    paper: str,
    statement: str,
    experiment: str,
    kind: str = "cheap",
    rule: str,
    compute: str = "",
    command: str | None = None,
):
    """Registers the decorated ``fn(settings) -> Finding`` as a claim under `key`, with the
    `rule` that decides it (required: a claim states its rule before its numbers)."""
    if paper not in PAPERS:
        raise ValueError(f"claim {key!r}: paper must be one of {PAPERS}, got {paper!r}")
    if kind not in KINDS:
        raise ValueError(f"claim {key!r}: kind must be one of {KINDS}, got {kind!r}")
    if not rule.strip():
        raise ValueError(f"claim {key!r}: rule must state how the verdict is decided")

    def register(fn):
        if key in CLAIMS:
            raise ValueError(f"claim {key!r} registered twice")
        CLAIMS[key] = Claim(
            key, paper, " ".join(statement.split()), experiment, fn, kind,
            rule=" ".join(rule.split()), command=command or f"{COMMAND} --only {key}",
            compute=compute,
        )  # fmt: skip
        return fn

    return register


def all_claims() -> dict[str, Claim]:
    """Every claim, in report order (importing the claim modules registers them)."""
    from train.claims import (  # noqa: F401
        ablations,
        distillation,
        flexformer,
        laplacian,
        randomized,
        table,
        trained,
    )

    return dict(sorted(CLAIMS.items(), key=lambda kv: PAPERS.index(kv[1].paper)))


def select(keys: Iterable[str] | None = None, kind: str = "all") -> list[Claim]:
    """The claims named by `keys` (all when None) of `kind` (``"all"``, ``"cheap"``, ``"train"``).

    Raises:
      KeyError: an unknown key (the message lists the known ones).
    """
    claims = all_claims()
    if keys:
        unknown = [k for k in keys if k not in claims]
        if unknown:
            raise KeyError(f"train.claims: unknown claim(s) {unknown}; known: {list(claims)}")
        chosen = [claims[k] for k in keys]
    else:
        chosen = list(claims.values())
    if kind not in ("all", *KINDS):
        raise ValueError(f"train.claims: kind must be 'all', 'cheap' or 'train', got {kind!r}")
    return [c for c in chosen if kind == "all" or c.kind == kind]


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def cache_path(settings: Settings, key: str) -> Path:
    return Path(settings.findings) / f"{key}.json"


def load(
    settings: Settings, key: str, kind: str | None = None, any_tasks: bool = False
) -> dict[str, Any] | None:
    """The current cached record of `key` (a claim of `kind`) under `settings` (same settings
    and code version), or None; with `any_tasks`, whatever table tasks it was run on."""
    record = latest(settings, key)
    return record if record is not None and not stale(record, settings, kind, any_tasks) else None


def latest(settings: Settings, key: str) -> dict[str, Any] | None:
    """The kept record of `key` whatever its settings, or None."""
    path = cache_path(settings, key)
    return json.loads(path.read_text()) if path.exists() else None


def stale(record: dict, settings: Settings, kind: str | None = None, any_tasks=False) -> str:
    """Why `record` is not a current finding under `settings` ('' when it is)."""
    from train.claims.cache import code_version

    got, want = dict(record.get("settings") or {}), settings.key(kind)
    if any_tasks:
        got.pop("tasks", None)
        want.pop("tasks", None)
    if got != want:
        diff = {k: got.get(k) for k in set(got) | set(want) if got.get(k) != want.get(k)}
        return "made under other settings " + ", ".join(f"{k}={v}" for k, v in diff.items())
    if record.get("code") != code_version():
        return "made with other code (the mechanism / training modules changed since)"
    return ""


def run(claims: Iterable[Claim], settings: Settings, *, rerun: bool = False, log=print):
    """Runs each claim (or reuses its current cached finding) and caches it; returns the
    records."""
    from train.claims.cache import code_version

    records = {}
    for c in claims:
        record = None if rerun else load(settings, c.key, c.kind)
        if record is None:
            log(f"[claims] {c.key} ...")
            t0 = time.perf_counter()
            finding = c.fn(settings)
            record = {
                "key": c.key,
                "finding": dataclasses.asdict(finding),
                "settings": settings.key(c.kind),
                "rule": c.rule,
                "code": code_version(),
                "commit": _commit(),
                "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                "seconds": round(time.perf_counter() - t0, 1),
                "machine": f"{platform.machine()}, {platform.processor() or platform.system()}",
            }
            path = cache_path(settings, c.key)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record, indent=1, default=str))
        log(f"[claims] {c.key}: {record['finding']['verdict']} ({record['seconds']} s)")
        records[c.key] = record
    return records


def run_seconds(settings: Settings, summaries: dict[Path, dict]) -> dict[str, float]:
    """``{run: wall seconds}`` from training runs' summaries (``{run directory: summary}``),
    each run named by its directory under the workdir, so that `compute_seconds` counts a
    run read by several claims once. A summary without a wall time (written before it was
    kept) counts 0."""
    root = Path(settings.workdir)
    return {
        str(Path(p).relative_to(root)): s.get("wall_seconds", 0.0) for p, s in summaries.items()
    }


def compute_seconds(records) -> float:
    """The compute behind `records`: every training run a finding read (its ``train_runs``,
    ``{run: wall seconds}``, kept by the training claims) counted once, though several claims
    read it, plus each claim's own time beyond its runs (the whole of it for a claim without
    runs; a claim that trained its runs itself took their time as well, so it is taken off)."""
    runs: dict[str, float] = {}
    own = 0.0
    for r in records:
        mine = (r["finding"].get("data") or {}).get("train_runs") or {}
        runs.update(mine)
        own += max(r["seconds"] - sum(mine.values()), 0.0)
    return own + sum(runs.values())


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _row(c: Claim, record: dict | None, why_stale: str) -> str:
    if record is None:
        result = f"pending: `{c.command}`" + (f" ({c.compute})" if c.compute else "")
        verdict = "pending"
    elif why_stale:
        result = (
            f"pending: `{c.command}`" + (f" ({c.compute})" if c.compute else "")
            + f". Earlier finding, {why_stale}: {record['finding']['numbers']}"
        )  # fmt: skip
        verdict = f"pending (earlier: {record['finding']['verdict']})"
    else:
        result, verdict = record["finding"]["numbers"], f"**{record['finding']['verdict']}**"
    cells = (c.statement, c.experiment, c.rule, result)
    return "| " + " | ".join(_cell(x) for x in cells) + f" | {verdict} |"


def _method() -> list[str]:
    """The report's method section, from the code's own settings."""
    from train.claims import cache, stats, table

    tasks = "; ".join(
        f"{t}: " + ", ".join(f"{k}={v}" for k, v in changes.items())
        for t, (_, changes) in table.TASKS.items()
    )
    return [
        "## Method",
        "",
        "**Verdicts.** " + "\n".join(stats.__doc__.split("\n\n", 1)[1].strip().splitlines()),
        "",
        f"**Power.** At least {MIN_SEEDS} seeds per accuracy comparison (`--seeds`, default "
        f"{MIN_SEEDS}); the table's budgets ({tasks}). A task counts as learned when softmax "
        f"reaches {table.LEARNED} test accuracy on every seed and is above each linear "
        "baseline by the interval; softmax runs first, and on a task it does not learn the "
        "other arms are not trained. Estimated compute per claim (from the v1 runs' wall "
        "times) is given beside each pending claim.",
        "",
        f"**Run cache.** {' '.join(' '.join(cache.__doc__.split(chr(10) * 2)[1:3]).split())} Code "
        f"version: the sha256 of {', '.join(cache.CODE_DIRS)} without "
        f"{', '.join(cache.EXCLUDED)}; a run's key leaves out the files private to the "
        "mechanisms it does not train (`train.claims.cache.private_files`: a change to one "
        "mechanism reruns only its runs, a change to shared or training code reruns all).",
        "",
    ]


def report(settings: Settings) -> str:
    """docs/claims.md from the kept findings under `settings`: a current finding with its
    verdict, an older one (other settings or code) as pending beside its old verdict, an
    unrun claim as pending with its command and compute; each claim's rule before its
    numbers."""
    claims = all_claims()
    records = {k: latest(settings, k) for k in claims}
    why = {
        k: stale(r, settings, claims[k].kind, any_tasks=True) if r else ""
        for k, r in records.items()
    }
    current = [r for k, r in records.items() if r and not why[k]]
    seconds = compute_seconds(current)
    flags = f" --seeds {settings.seeds}" + (" --quick" if settings.quick else "")
    lines = [
        "# The seeds' claims, tested at small scale",
        "",
        f"Generated by `{COMMAND}{flags}` (each claim's finding is kept in "
        f"`{settings.findings}/<key>.json`; `--only KEY` reruns one, `--report-only` rebuilds "
        f"this page from them). {len(current)} of {len(claims)} claims have a current "
        f"finding, {seconds / 60:.1f} min of compute in total, on the machine named per claim. "
        f"Verdicts: {', '.join(VERDICTS)}; each is decided by the rule stated beside its "
        "claim, before its numbers (comparisons: from a 95% interval of the difference, "
        "`train.claims.stats`). A claim without a current finding (none yet, or one made "
        "under other settings or code) is pending, with the command that runs it and its "
        "estimated compute. A claim that does not reproduce at this scale is a finding, and "
        "its row says what would change it.",
        "",
        *_method(),
    ]
    for paper in PAPERS:
        mine = [c for c in claims.values() if c.paper == paper]
        if not mine:
            continue
        lines += [f"## {paper}", "", "| claim | experiment | rule | result | verdict |"]
        lines.append("|---|---|---|---|---|")
        lines += [_row(c, records[c.key], why[c.key]) for c in mine]
        lines.append("")
        for c in mine:
            r = records[c.key]
            if r is None:
                continue
            tasks = r["settings"].get("tasks")
            on = f", table tasks: {', '.join(tasks)}" if tasks else ""
            earlier = ""
            if why[c.key]:
                ruled = (
                    "decided before rules were kept (v1; its +- are population stds, ddof = 0)"
                    if not r.get("rule")
                    else "" if r["rule"] == c.rule else f"decided by an earlier rule: {r['rule']}"
                )  # fmt: skip
                earlier = f"earlier finding, {why[c.key]}" + (f"; {ruled}" if ruled else "") + "; "
            lines += [
                f"**`{c.key}`** ({earlier}{r['seconds']} s, commit {r['commit']}, "
                f"{r['date']}{on}): " + " ".join(r["finding"]["why"].split()),
                "",
            ]
            data = r["finding"].get("data") or {}
            if data.get("markdown"):  # a finding's own table, rendered by its claim
                lines += [data["markdown"].rstrip(), ""]
            plot = data.get("plot")
            if plot:  # written beside the finding; the report sits beside the findings folder
                lines += [f"![{c.key}]({Path(settings.findings).name}/{plot})", ""]
    return "\n".join(lines).rstrip() + "\n"


def grade(*checks: bool) -> str:
    """The verdict of a claim tested by several checks: reproduced when all hold, partly when
    some do, not reproduced when none does."""
    return REPRODUCED if all(checks) else PARTLY if any(checks) else NOT_REPRODUCED


def mean_std(xs: Iterable[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof = 1; 0 for a single value)."""
    xs = [float(x) for x in xs]
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5


def fit_slope(xs: Iterable[float], ys: Iterable[float]) -> float:
    """Least-squares slope of ``log y`` against ``log x``."""
    import numpy as np

    lx, ly = np.log(np.asarray(list(xs), float)), np.log(np.asarray(list(ys), float))
    return float(np.polyfit(lx, ly, 1)[0])
