"""The command-line pieces every entry point shares: one parser builder and one `build_config`.

Entry points (``python -m train``, ``train.lm``, ``train.vision``, ``train.results``,
``train.distill``, ``train.bench``) build their parser with `parser`, add their own flags,
read ``argv`` with `parse` (which also accepts ml_collections-style ``--config.a.b=v``) and
turn the result into a training config with `build_config`. Nothing but the entry points
imports this module (tests/test_layout.py checks it).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from train import configs

#: the flags `parser` can add, with their meaning (all optional on the command line)
COMMON_FLAGS = (
    "task",
    "preset",
    "attention",
    "workdir",
    "steps",
    "seed",
    "data_dir",
    "set",
    "no_progress",
    "restart",
)

#: ``--restart``'s help (also what `train.guard` allows on resume)
RESTART_HELP = (
    "delete this workdir's run (checkpoints, metrics, summary) and start from step 0. "
    "Without it a rerun resumes the workdir's run, and one of another config is refused; "
    "only intervals, evaluation, logging and placement settings may differ "
    "(train.guard.RESUMABLE), and --steps may grow when the learning rates of the steps "
    "already run stay the same (rsqrt, constant; cosine within its warmup)"
)


def parser(
    prog: str,
    description: str | None = None,
    *,
    task: str | None = "listops",
    preset: str = "mini",
    attention: str | None = "flexformer_n",
    attention_flag: str = "--attention",
    attention_help: str = "attention mechanism (registry name)",
    preset_help: str = "mini (CPU minutes) or full (LRA settings)",
    flags: Sequence[str] = COMMON_FLAGS,
    raw_description: bool = True,
) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` with the shared training flags.

    Args:
      prog: as for ``argparse``.
      description: as for ``argparse``.
      task: the ``--task`` default (None: no ``--task`` flag; the entry sets the task).
      preset: the ``--preset`` default.
      attention: the mechanism flag's default (None: no mechanism flag).
      attention_flag: its name (``--attention``; distillation uses ``--student``). The value
        is stored as ``args.attention`` either way.
      attention_help: help text of the mechanism flag.
      preset_help: help text of ``--preset``.
      flags: which of `COMMON_FLAGS` to add.
      raw_description: keep the description's line breaks.
    """
    unknown = set(flags) - set(COMMON_FLAGS)
    if unknown:
        raise ValueError(f"flags {sorted(unknown)} are not among COMMON_FLAGS {COMMON_FLAGS}")
    p = argparse.ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=(
            argparse.RawDescriptionHelpFormatter if raw_description else argparse.HelpFormatter
        ),
    )
    if task is not None and "task" in flags:
        p.add_argument("--task", default=task, help=f"one of {sorted(configs.CONFIGS)}")
    if "preset" in flags:
        p.add_argument("--preset", default=preset, help=preset_help)
    if attention is not None and "attention" in flags:
        p.add_argument(attention_flag, dest="attention", default=attention, help=attention_help)
    if "workdir" in flags:
        p.add_argument("--workdir", default=None, help="default: a name from the run's settings")
    if "steps" in flags:
        p.add_argument("--steps", type=int, default=None, help="override num_train_steps")
    if "seed" in flags:
        p.add_argument("--seed", type=int, default=None, help="override seed (init and step rng)")
    if "data_dir" in flags:
        p.add_argument("--data_dir", default=None, help="override data.data_dir")
    if "set" in flags:
        p.add_argument(
            "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
        )
    if "no_progress" in flags:
        p.add_argument("--no_progress", action="store_true", help="no progress bar")
    if "restart" in flags:
        p.add_argument("--restart", action="store_true", help=RESTART_HELP)
    return p


def parse(
    p: argparse.ArgumentParser, argv: Sequence[str] | None = None, *, config_flags: bool = True
) -> tuple[argparse.Namespace, list[str]]:
    """``(args, overrides)`` of `argv` (default ``sys.argv[1:]``).

    ``overrides`` are the ``--set`` values followed, with `config_flags`, by every
    ``--config.a.b=v`` (ml_collections config_flags style) in order; any other unknown
    argument is an error.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not config_flags:
        args = p.parse_args(argv)
        return args, list(getattr(args, "set", None) or [])
    args, rest = p.parse_known_args(argv)
    overrides = list(getattr(args, "set", None) or [])
    for item in rest:
        if item.startswith("--config.") and "=" in item:
            overrides.append(item[len("--config.") :])
        else:
            p.error(f"unrecognized argument {item!r}")
    return args, overrides


def build_config(args: Any, overrides: Sequence[str] = (), *, task: str | None = None):
    """The training config of parsed `args` (a Namespace or any object with the attributes).

    ``configs.get_config(task, preset)``, then `set_attention` (so the previous
    mechanism's keys never leak into the new one), then ``--steps``, ``--seed``,
    ``--data_dir``, ``--no_progress``, ``--distributed`` where given, then `overrides` (the
    ``--set`` / ``--config.`` values) last, so they win.

    Args:
      args: reads ``task`` (unless `task` is given), ``preset``, ``attention`` and, when
        present and not None, ``steps``, ``seed``, ``data_dir``, ``no_progress``,
        ``distributed``.
      overrides: ``key=value`` strings (`configs.apply_overrides`).
      task: the task when the entry point fixes it (``train.lm``: ``"lm"``).
    """
    task = task or getattr(args, "task", None)
    if task is None:
        raise ValueError("build_config needs a task: args.task or task=")
    config = configs.get_config(task, args.preset)
    attention = getattr(args, "attention", None)
    if attention is not None:
        set_attention(config, attention)
    if getattr(args, "steps", None) is not None:
        config.num_train_steps = int(args.steps)
    if getattr(args, "seed", None) is not None:
        config.seed = int(args.seed)
    if getattr(args, "data_dir", None) is not None:
        config.data.data_dir = args.data_dir
    if getattr(args, "no_progress", False):
        config.progress_bar = False
    if getattr(args, "distributed", False):
        config.distributed = True
    configs.apply_overrides(config, overrides)
    return config


def original_name(name: str) -> str:
    """`linattn_jax.origin` of a registered `name` (the record a renamed copy was made from);
    an unregistered `name` itself (left to the trainer's error)."""
    import linattn_jax as la  # here, so `--help` and bad flags answer without loading jax

    return la.origin(name) if name in la.names() else name


def set_attention(config, name: str):
    """``configs.set_attention(config, name)`` with the preset settings of `name`'s original
    (`original_name`), so a renamed copy of a registered record trains exactly as the
    original."""
    return configs.set_attention(config, name, like=original_name(name))


def expected_error(error: BaseException) -> bool:
    """Whether `error` is one a command reports in one line (`run`): a bad setting or a
    refused workdir (`train.guard`), a missing data set, an OS error (it names its path)."""
    from train.data import DatasetNotFoundError
    from train.errors import ConfigError, WorkdirError

    return isinstance(error, (ConfigError, WorkdirError, DatasetNotFoundError, OSError))


def error_line(error: BaseException) -> str:
    """``error: <message>`` on one line."""
    return "error: " + " ".join(str(error).split())


def run(main: Callable[[Any], Any], argv: Sequence[str] | None = None) -> int:
    """An entry's exit status: ``main(argv)``, then 0; an `expected_error` prints
    `error_line` on stderr (no traceback) and gives 2."""
    try:
        main(argv)
    except Exception as error:
        if not expected_error(error):
            raise
        print(error_line(error), file=sys.stderr, flush=True)
        return 2
    return 0


def default_workdir(config, *, prefix: str = "workdir", name: str | None = None) -> str:
    """``<prefix>/<task>_<preset>_<attention>`` (or ``<prefix>/<name>``)."""
    return f"{prefix}/{name or f'{config.task}_{config.preset}_{config.attention}'}"


__all__ = [
    "COMMON_FLAGS",
    "RESTART_HELP",
    "build_config",
    "default_workdir",
    "error_line",
    "expected_error",
    "parse",
    "parser",
    "run",
]
