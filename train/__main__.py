"""``python -m train``: train, evaluate, checkpoint and summarise one LRA run.

With no flags: ListOps mini (generated locally, nothing downloaded), a 2-layer width-64
encoder with ``flexformer_n`` attention, 500 steps; shows a progress bar, evaluates every
100 steps, checkpoints to ``workdir/listops_mini_flexformer_n`` (rerun to resume) and
prints a summary. Examples::

    python -m train --attention softmax --steps 200
    python -m train --task pathfinder --preset mini --set model.num_layers=1
    python -m train --task listops --preset full --config.mesh_shape='(-1, 4)'

Any config field (``train/configs/default.py``) can be overridden with ``--set a.b=v`` or
``--config.a.b=v`` (repeatable; values are Python literals or strings).

A rerun in the same workdir resumes its run (its ``config.json`` is the run's identity):
a finished run prints its stored summary and trains and appends nothing; a run of another
config is refused (exit 2, one line naming the keys that differ) unless ``--restart``
deletes it and starts over. Keys that may differ on resume (``train.guard.RESUMABLE``):
log_every, eval_every, checkpoint_every, max_to_keep, the evaluation and output switches,
data locations, the mesh and the multi-host settings; ``--steps`` may grow when the
learning rates of the steps already run stay the same (rsqrt and constant schedules,
cosine within its warmup).

The summary ends with softmax's accuracy on the same budget: ``--compare softmax`` trains
it (in ``<workdir>_softmax``), otherwise the stored `REFERENCES` entry is printed when
the run is the default budget of its task (no ``--set`` / ``--seed``), with the command
that produced it.
"""

from __future__ import annotations

import argparse
import logging
import sys

from train import cli, configs

#: softmax on the default budget of ``(task, preset, steps)``, printed beside the summary.
#: Regenerate with the command stored beside the numbers (nothing else changes them).
REFERENCES = {
    ("listops", "mini", 500): {
        "val": 0.36800000071525574,
        "test": 0.39399999380111694,
        "command": "python -m train --attention softmax",
    },
}


def parser():
    """The ``python -m train`` parser (`train.cli.parser` plus ``--compare``, ``--distributed``)."""
    p = cli.parser("python -m train", __doc__)
    p.formatter_class = argparse.RawTextHelpFormatter
    p.add_argument(
        "--compare",
        default=None,
        metavar="ATTENTION",
        help="also train this mechanism on the same config and print both (e.g. softmax)",
    )
    p.add_argument(
        "--distributed", action="store_true", help="jax.distributed.initialize() (multi-host)"
    )
    return p


def parse_args(argv):
    """``(args, overrides)``: the flags, and the ``--set`` / ``--config.a.b=v`` overrides."""
    return cli.parse(parser(), argv)


build_config = cli.build_config


def config_from_argv(argv):
    """``(args, overrides, config)``: what ``python -m train <argv>`` would train."""
    args, overrides = parse_args(argv)
    return args, overrides, build_config(args, overrides)


def main(argv=None) -> dict:
    """Parse ``argv``, run ``train_and_evaluate``, print the summary; returns it."""
    args, overrides, config = config_from_argv(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Imported here so `--help` and bad flags answer without loading jax.
    from train import loop

    loop.maybe_initialize_distributed(config)
    workdir = args.workdir or cli.default_workdir(config)
    summary = loop.train_and_evaluate(config, workdir, restart=args.restart)
    other = None
    if args.compare:
        other_config = cli.set_attention(config.copy_and_resolve_references(), args.compare)
        configs.apply_overrides(other_config, overrides)
        other = loop.train_and_evaluate(
            other_config, f"{workdir}_{args.compare}", restart=args.restart
        )
    import jax

    if jax.process_index() == 0:
        print(loop.format_summary(summary), flush=True)
        line = comparison_line(summary, other, args, overrides)
        if line:
            print(line, flush=True)
    return summary


def _pct(x):
    return "n/a" if x is None else f"{100 * x:.1f}%"


def comparison_line(summary, other, args, overrides) -> str | None:
    """The summary's last line: the other mechanism's accuracy on the same budget."""
    mine = (
        f"{summary['attention']} val {_pct(summary['val'].get('accuracy'))} / test "
        f"{_pct(summary['test'].get('accuracy'))}"
    )
    if other is not None:
        return (
            f"same budget: {mine}; {other['attention']} val "
            f"{_pct(other['val'].get('accuracy'))} / test {_pct(other['test'].get('accuracy'))}"
        )
    ref = REFERENCES.get((summary["task"], summary["preset"], summary["steps"]))
    if ref is None or overrides or args.seed is not None:
        return None
    if cli.original_name(summary["attention"]) == "softmax":  # no line against itself
        return None
    return (
        f"same budget: {mine}; softmax val {_pct(ref['val'])} / test {_pct(ref['test'])} "
        f"(stored reference: {ref['command']})"
    )


if __name__ == "__main__":
    sys.exit(cli.run(main))
