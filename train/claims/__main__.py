"""``python -m train.claims``: run the seeds' claims (cached) and write docs/claims.md.

python -m train.claims --kind cheap          # estimator / solver / memory claims (minutes)
python -m train.claims --kind train          # the equal-budget table and its claims
python -m train.claims --kind train --tasks pathfinder   # ... on one of its tasks
python -m train.claims --only ra.unbiased    # one claim (rerun with --rerun)
python -m train.claims --report-only         # rewrite the report from docs/claims/*.json
python -m train.claims --list                # every claim: kind, paper, statement

Defaults are the power settings (5 seeds; the budgets of train.claims.table).
Training runs are cached by config and code version: an interrupted claim resumes, a
stale run reruns (train.claims.cache).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from train import claims
from train.claims.table import TASKS


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m train.claims", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--only", nargs="+", default=None, help="claim keys (see --list)")
    p.add_argument("--kind", default="all", choices=("all", *claims.KINDS))
    p.add_argument(
        "--seeds",
        type=int,
        default=claims.MIN_SEEDS,
        help=f"seeds per comparison (default {claims.MIN_SEEDS}; fewer is flagged)",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes (tests; numbers meaningless)")
    p.add_argument("--workdir", default="workdir/claims", help="training runs")
    p.add_argument(
        "--findings",
        default=None,
        help="the findings, <key>.json each (default docs/claims; with --quick "
        "<workdir>/quick_findings, so tiny runs never replace the kept ones)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="the report ('' = do not write; default docs/claims.md, with --quick "
        "<workdir>/quick_claims.md, so a tiny run never replaces the kept report)",
    )
    p.add_argument("--rerun", action="store_true", help="ignore cached findings")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--list", action="store_true", help="list the claims and exit")
    p.add_argument(
        "--tasks",
        nargs="+",
        default=None,
        choices=tuple(TASKS),
        help="the equal-budget table's tasks for the training claims (default: all); a finding "
        "is reused only for the same tasks",
    )
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.seeds < claims.MIN_SEEDS and not args.quick:
        print(
            f"warning: --seeds {args.seeds} < {claims.MIN_SEEDS}: accuracy comparisons are "
            "under-powered"
        )
    findings = args.findings or (
        Path(args.workdir) / "quick_findings" if args.quick else claims.Settings.findings
    )
    settings = claims.Settings(
        seeds=args.seeds,
        quick=args.quick,
        workdir=Path(args.workdir),
        findings=Path(findings),
        tasks=None if args.tasks is None else tuple(args.tasks),
    )
    chosen = claims.select(args.only, args.kind)
    if args.list:
        for c in chosen:
            print(f"{c.key:32s} {c.kind:5s} {c.paper}: {c.statement}")
        return {}
    records = {} if args.report_only else claims.run(chosen, settings, rerun=args.rerun)
    text = claims.report(settings)
    out = args.out
    if out is None:
        out = Path(args.workdir) / "quick_claims.md" if args.quick else "docs/claims.md"
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
        print(f"wrote {out}")
    return records


if __name__ == "__main__":
    main()
