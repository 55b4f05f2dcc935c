"""What a training run checks before it writes anything: its settings, and what its workdir
already holds.

`train.loop.train_and_evaluate` calls `check_config` and then `prepare_workdir`, so every entry
point on the loop (``python -m train``, ``train.vision``, ``train.lm``, ``train.results``,
``train.distill``) gets the same rules:

- Non-positive ``num_train_steps``, ``log_every``, ``eval_every``, ``checkpoint_every``,
  ``max_to_keep``, ``batch_size`` or ``eval_batch_size``, an unknown ``attention``: a
  `train.errors.ConfigError` before the workdir is touched (or created).
- The workdir's ``config.json`` (written once its checkpoints restore) is its identity. A
  rerun whose config differs from it in any key but those of `RESUMABLE` is refused with a
  `train.errors.WorkdirError` naming the keys that differ; nothing in the workdir is moved or
  changed.
  ``num_train_steps`` may grow (extend a run) when the learning rates of the steps already
  run stay the same (`same_learning_rates`: rsqrt and constant schedules, cosine within its
  warmup): the extended run is then the run of the new config.
- A finished run (``summary.json`` at ``num_train_steps``) is not trained or evaluated again:
  its stored summary comes back (``"rerun": True``) and nothing is appended.
- ``restart=True`` deletes the run files of `RUN_FILES` first and starts from step 0.
- An OS error on the way (the workdir is a file, read-only, a full disk) names the path
  (`os_errors`).

When the workdir has checkpoints but none restores, `train.checkpoint.Checkpointer` raises a
`WorkdirError` too (nothing moved). Command-line entries print these errors as one line and
exit 2 (`train.cli.run`); all but ``train.distill`` take ``--restart``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from train.errors import WAY_ON, ConfigError, WorkdirError
from train.schedules import learning_rate_schedule

#: config keys that may differ on resume: they change what is logged, evaluated or saved and
#: where or how the run executes, never the training trajectory (the mesh keys change float
#: reduction order only). ``num_train_steps`` is handled apart (it may grow, see module doc).
RESUMABLE = frozenset(
    {
        "log_every",
        "eval_every",
        "checkpoint_every",
        "max_to_keep",
        "async_checkpointing",
        "progress_bar",
        "tensorboard",
        "plot",
        "compile_memory_analysis",
        "eval_test",
        "num_eval_batches",
        "eval_batch_size",
        "data.data_dir",
        "data.lra_dir",
        "data.tfds_data_dir",
        "data.num_threads",
        "mesh_shape",
        "mesh_axes",
        "data_axes",
        "logical_axis_rules",
        "distributed",
        "coordinator_address",
        "num_processes",
        "process_id",
    }
)


#: what a run writes in its workdir (``restart=True`` deletes these, nothing else)
RUN_FILES = (
    "checkpoints",
    "best",
    "checkpoints_corrupt",
    "tb",
    "metrics.jsonl",
    "metrics.jsonl.tmp",
    "summary.json",
    "curves.png",
    "config.json",
)

#: how a refusal says the way on
_POSITIVE = (
    "num_train_steps",
    "log_every",
    "eval_every",
    "checkpoint_every",
    "max_to_keep",
    "batch_size",
    "eval_batch_size",
)


def check_config(config) -> None:
    """Raises `ConfigError` for a setting no run can start with (see the module doc)."""
    for key in _POSITIVE:
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            flag = " (--steps)" if key == "num_train_steps" else ""
            raise ConfigError(f"{key}{flag} must be an integer >= 1, got {value!r}")
    import linattn_jax as la

    if config.get("attention") not in la.names():
        raise ConfigError(f"attention must be one of {la.names()}, got {config.get('attention')!r}")


def config_dict(config) -> dict[str, Any]:
    """The JSON form of `config` (what ``config.json`` holds)."""
    return json.loads(config.to_json_best_effort())


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: tree}


def _short(value: Any) -> str:
    text = "<absent>" if value is _ABSENT else json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


_ABSENT = object()


def config_differences(stored: dict[str, Any], config) -> list[str]:
    """``"key: old -> new"`` for every key where `config` may not resume the run of
    `stored` (a ``config.json`` dict); empty when it may."""
    old, new = _flat(stored), _flat(config_dict(config))
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if a == b or key in RESUMABLE:
            continue
        if key == "num_train_steps" and isinstance(a, int) and isinstance(b, int):
            if b > a and same_learning_rates(config, a):
                continue
            why = (
                "may only grow"
                if b < a
                else f"would change the {config.get('schedule')} learning rate of steps run"
            )
            out.append(f"{key}: {a} -> {b} ({why})")
            continue
        out.append(f"{key}: {_short(a)} -> {_short(b)}")
    return out


def same_learning_rates(config, old_steps: int) -> bool:
    """Whether `config`'s schedule gives steps ``0 .. old_steps - 1`` the learning rates it
    gave them with ``num_train_steps = old_steps``: always for rsqrt and constant, for cosine
    while those steps are all in the warmup (its decay spans the total)."""
    old = config.copy_and_resolve_references()
    old.num_train_steps = int(old_steps)
    steps = jnp.arange(int(old_steps))
    now, then = learning_rate_schedule(config)(steps), learning_rate_schedule(old)(steps)
    return bool(np.array_equal(np.asarray(now), np.asarray(then)))


def _read_json(path: Path) -> Any:
    """The JSON of a regular file at `path`, or None (absent, not a file, unreadable)."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def restart_workdir(workdir: Path) -> list[str]:
    """Deletes the `RUN_FILES` in `workdir`; returns the names it deleted."""
    gone = []
    for name in RUN_FILES:
        path = workdir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        gone.append(name)
    return gone


def prepare_workdir(
    config, workdir: Path, *, restart: bool = False, delete: bool = True
) -> dict | None:
    """Checks what `workdir` holds against `config` (before anything is written).

    Returns the stored summary (with ``"rerun": True``) when the workdir holds the finished
    run of `config`, else None (train: from step 0, or resume its checkpoints).

    ``restart``: delete the run files first (only where ``delete``: process 0 of a
    multi-process run; the others wait for it, see `train.loop.train_and_evaluate`).

    Raises:
      WorkdirError: `workdir` is not a directory, or holds a run of another config.
    """
    if workdir.exists() and not workdir.is_dir():
        raise WorkdirError(f"workdir {workdir} exists and is not a directory")
    if not workdir.is_dir():
        return None
    if restart:
        if delete:
            restart_workdir(workdir)
        return None
    stored = _read_json(workdir / "config.json")
    if isinstance(stored, dict):
        diff = config_differences(stored, config)
        if diff:
            raise WorkdirError(
                f"workdir {workdir} holds a run of another config ({'; '.join(diff)}): {WAY_ON}"
            )
    summary = _read_json(workdir / "summary.json")
    if (
        isinstance(stored, dict)
        and isinstance(summary, dict)
        and summary.get("steps") == int(config.num_train_steps)
    ):
        return {**summary, "rerun": True}
    return None


@contextlib.contextmanager
def os_errors(workdir: Path):
    """Gives an ``OSError`` raised inside without a file name (e.g. a full disk on write)
    the workdir's, so that its message names a path."""
    try:
        yield
    except OSError as error:
        if error.filename is None and error.errno is not None:
            error.filename = str(workdir)
        raise


__all__ = [
    "RESUMABLE",
    "RUN_FILES",
    "check_config",
    "config_dict",
    "config_differences",
    "os_errors",
    "prepare_workdir",
    "restart_workdir",
    "same_learning_rates",
]
