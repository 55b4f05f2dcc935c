"""``python -m train.bench <subcommand> [flags]``: the parser; each subcommand's module does
the work (see `train.bench`)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import train.bench
from train.bench import (
    common,
    equivalence,
    fidelity,
    isolation,
    kernel_fit,
    model,
    official,
    parallel,
    performer_jax,
    scaling,
    summary,
)

#: Subcommands that measure mechanisms: name -> (module, help).
MEASURED = {
    "scaling": (scaling, "time and memory vs T"),
    "fidelity": (fidelity, "error vs softmax as the budget grows"),
    "model": (model, "LRA-Retrieval-shaped training step per mechanism"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train.bench", description=train.bench.__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("scaling", "fidelity"):
        module, help_ = MEASURED[name]
        module.add_arguments(sub.add_parser(name, help=help_))
    k = sub.add_parser(
        "kernels", help="Pallas kernels vs XLA: every other flag goes to python -m kernels.bench"
    )
    k.add_argument("--out", default=None)
    module, help_ = MEASURED["model"]
    module.add_arguments(sub.add_parser("model", help=help_))
    kernel_fit.add_arguments(
        sub.add_parser("kernel_fit", help="fit learnable kernels to a non-stationary target")
    )
    equivalence.add_arguments(
        sub.add_parser("equivalence", help="train a mechanism beside its public algorithm")
    )
    official.add_arguments(
        sub.add_parser("official", help="our LARA beside the official PyTorch code, equal cores")
    )
    performer_jax.add_arguments(
        sub.add_parser("performer_jax", help="our performer beside the public Performer-JAX")
    )
    parallel.add_arguments(
        sub.add_parser("parallel", help="per-device memory of sequence-parallel attention")
    )
    summary.add_arguments(sub.add_parser("report", help="markdown summary from the JSON results"))
    return parser


def main(argv: Sequence[str] | None = None) -> dict | str | list:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] == "kernels":
        args, rest = parser.parse_known_args(argv)
    else:
        args, rest = parser.parse_args(argv), []

    if args.command == "kernels":
        from kernels import bench as kbench

        table = kbench.main(rest)
        common.write_json(
            {"kind": "kernels", "environment": common.environment(), "table": table}, args.out
        )
        return table
    if args.command == "kernel_fit":
        return kernel_fit.main_from_args(args)
    if args.command == "equivalence":
        return equivalence.main_from_args(args)
    if args.command == "official":
        return official.main_from_args(args)
    if args.command == "performer_jax":
        return performer_jax.main_from_args(args)
    if args.command == "parallel":
        return parallel.main_from_args(args, parser)
    if args.command == "report":
        return summary.main_from_args(args)

    for name in args.imports:
        importlib.import_module(name)
    module = MEASURED[args.command][0]
    result, table = module.run_from_args(
        args, isolation.strip_flags(argv), isolation.logger(args.quiet)
    )
    if not args.jsonl:  # a child only reports through its JSON lines
        print(table)
        common.write_json(result, args.out)
        if args.plot:
            module.plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
