"""One subprocess per mechanism (``--isolate``): a hang or an out-of-memory kill costs one
mechanism's remaining points, not the run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence

#: Flags without a value.
BOOLEAN_FLAGS = ("--quiet", "--isolate", "--no-isolate")
#: Flags the parent keeps to itself: the rest of its argv is the child's.
PARENT_ONLY = ("--mechanisms", "--out", "--plot", "--quiet", "--isolate", "--no-isolate", "--jsonl")


def add_isolation_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one subprocess per mechanism under a hard timeout (default on)",
    )
    p.add_argument("--mechanism-timeout-s", type=float, default=900.0)


def strip_flags(argv: Sequence[str], flags: Sequence[str] = PARENT_ONLY) -> list[str]:
    """argv without `flags` (and their values): what the parent passes to its children."""
    out, skip = [], False
    for a in argv:
        if skip:
            if a.startswith("--"):
                skip = False
            else:
                continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = "=" not in a and name not in BOOLEAN_FLAGS
            continue
        out.append(a)
    return out


def run_isolated(name: str, argv: Sequence[str], timeout_s: float) -> list[dict]:
    """Runs ``python -m train.bench`` for one mechanism in a subprocess with a hard timeout.

    The child writes each result as it lands (JSON lines in a temp file), so a timeout or an
    out-of-memory kill keeps the points finished before it.
    """
    with tempfile.TemporaryDirectory() as tmp:
        lines = os.path.join(tmp, "points.jsonl")
        cmd = [sys.executable, "-m", "train.bench", *argv, "--mechanisms", name]
        cmd += ["--no-isolate", "--jsonl", lines, "--quiet"]
        note = ""
        try:
            proc = subprocess.run(cmd, timeout=timeout_s, capture_output=True, text=True)
            if proc.returncode != 0:
                note = f"subprocess exited {proc.returncode}: {proc.stderr.strip()[-300:]}"
        except subprocess.TimeoutExpired:
            note = f"subprocess timed out after {timeout_s:.0f} s"
        points = []
        if os.path.exists(lines):
            with open(lines) as fh:
                points = [json.loads(line) for line in fh if line.strip()]
    if note:
        points.append({"mechanism": name, "status": "error", "note": note})
    return points


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How `run_mechanisms` runs: in this process or (`isolate`) one subprocess per mechanism
    under `mechanism_timeout_s`, started with `argv`; a child appends each point to `jsonl`;
    `log` gets progress lines."""

    isolate: bool = False
    mechanism_timeout_s: float = 900.0
    argv: Sequence[str] = ()
    jsonl: str | None = None
    log: Callable[[str], None] | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, child_argv: Sequence[str], log) -> RunOptions:
        """The options of parsed `add_isolation_arguments` (and ``--jsonl``) flags."""
        return cls(args.isolate, args.mechanism_timeout_s, tuple(child_argv), args.jsonl, log)


#: Every mechanism in this process, silently (the default of `run_mechanisms`' callers).
IN_PROCESS = RunOptions()


def run_mechanisms(
    names: Sequence[str],
    measure_one: Callable[[str, Callable[[dict], None]], list[dict]],
    options: RunOptions,
    *,
    label: str,
    describe: Callable[[dict], str] = str,
) -> list[dict]:
    """Every point of every mechanism of `names`, in order.

    In this process ``measure_one(name, emit)`` returns a mechanism's points and calls
    ``emit(point)`` as each lands (which appends it to ``options.jsonl``: how a child reports
    to its parent); with ``options.isolate``, `run_isolated` runs ``python -m train.bench
    *options.argv`` for each mechanism. ``options.log`` gets ``"<label>: <name>"`` per
    mechanism and ``"  <describe(point)>"`` per point (including the error point of a
    subprocess that failed).
    """
    log = options.log

    def emit(point: dict) -> None:
        if not options.isolate:
            append_jsonl(options.jsonl, point)
        if log:
            log(f"  {describe(point)}")

    points: list[dict] = []
    for name in names:
        if log:
            log(f"{label}: {name}")
        if options.isolate:
            new = run_isolated(name, options.argv, options.mechanism_timeout_s)
            for p in new:
                emit(p)
        else:
            new = measure_one(name, emit)
        points += new
    return points


def append_jsonl(path: str | None, point: dict) -> None:
    """A child's result line (nothing when `path` is None)."""
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(point) + "\n")


def logger(quiet: bool) -> Callable[[str], None]:
    """Progress lines on stderr (silent with `quiet`)."""

    def log(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    return log
