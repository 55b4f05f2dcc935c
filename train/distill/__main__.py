"""python -m train.distill: distil a softmax model into linear attention, or transfer
distilled feature maps to another task.

  python -m train.distill run --task listops --preset mini --student flexformer_n \\
      --teacher_workdir workdir/listops_mini_softmax --train_teacher --baselines
  python -m train.distill transfer --task text --preset mini --student flexformer_n \\
      --teacher_workdir workdir/text_mini_softmax --train_teacher \\
      --source workdir/distill/listops_mini_flexformer_n/feature_maps.msgpack

The teacher is the same config with softmax attention, read from --teacher_workdir (best
checkpoint, else latest); --train_teacher trains it there first if it has no checkpoint.
Transfer needs the two tasks' models to have the same layers, heads and head size (the LRA
mini presets of listops, text, retrieval and pathfinder do; image's has one layer).
Stage 2 (and the baselines, and transfer --finetune) run config.num_train_steps steps of
the ordinary training loop (`python -m train`): progress bar, checkpoints, metrics, summary.
Config fields: --set key=value (as for python -m train), e.g. --set num_train_steps=200.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from train import cli
from train.distill.losses import distillable_names, student_feature_map
from train.distill.stages import distill, format_summary, kernel_transfer


def parser() -> argparse.ArgumentParser:
    """The ``python -m train.distill`` parser (`train.cli.parser` plus the stage flags)."""
    p = cli.parser(
        "python -m train.distill",
        __doc__,
        attention_flag="--student",
        attention_help=f"one of {distillable_names()}",
        flags=(
            "task",
            "preset",
            "attention",
            "workdir",
            "data_dir",
            "set",
            "no_progress",
            "restart",
        ),
    )
    p.add_argument("command", nargs="?", default="run", choices=("run", "transfer"))
    p.add_argument("--teacher_workdir", default=None, help="the softmax run's workdir")
    p.add_argument("--train_teacher", action="store_true", help="train the teacher if absent")
    p.add_argument("--stage1_steps", type=int, default=300)
    p.add_argument("--stage1_lr", type=float, default=1e-2)
    p.add_argument("--block_size", type=int, default=128, help="query rows per loss block")
    p.add_argument("--no_stage2", action="store_true", help="stop after attention matching")
    p.add_argument("--stage2_lr", type=float, default=None, help="default: config.learning_rate")
    p.add_argument("--baselines", action="store_true", help="also train without stage 1 / scratch")
    p.add_argument("--source", default=None, help="transfer: feature_maps.msgpack of task A")
    p.add_argument("--own", default=None, help="transfer: B's own maps (default: distil now)")
    p.add_argument("--finetune", action="store_true", help="transfer: also fine-tune each")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    p = parser()
    args, overrides = cli.parse(p, argv, config_flags=False)
    config = cli.build_config(args, overrides)
    student_feature_map(args.attention, config.attention_config)
    teacher_dir = args.teacher_workdir or f"workdir/{args.task}_{args.preset}_softmax"
    stage1 = dict(
        stage1_steps=args.stage1_steps,
        stage1_lr=args.stage1_lr,
        block_size=args.block_size,
        train_teacher=args.train_teacher,
        restart=args.restart,
    )
    if args.command == "run":
        summary = distill(
            config,
            teacher_workdir=teacher_dir,
            workdir=args.workdir or cli.default_workdir(config, prefix="workdir/distill"),
            stage2=not args.no_stage2,
            stage2_lr=args.stage2_lr,
            baselines=args.baselines,
            **stage1,
        )
        print(format_summary(summary), flush=True)
        return summary
    if args.source is None:
        p.error("transfer needs --source (a feature_maps.msgpack written by `run`)")
    return kernel_transfer(
        config,
        teacher_workdir=teacher_dir,
        source=args.source,
        own=args.own,
        workdir=args.workdir or cli.default_workdir(config, prefix="workdir/transfer"),
        finetune=args.finetune,
        **stage1,
    )


if __name__ == "__main__":
    import sys

    sys.exit(cli.run(main))
