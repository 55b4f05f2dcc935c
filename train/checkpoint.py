"""Orbax checkpoints: the latest N for resumption, and the best one by an eval metric.

Layout under the work directory::

    checkpoints/<step>/{state,meta}   latest ``max_to_keep`` (async saves)
    best/<step>/{state,meta}          the single best by ``best_metric`` (``best_mode``)
    checkpoints_corrupt/<step>-<time> checkpoints that failed to restore, moved aside

``state`` is the train state pytree (restored onto abstract, sharded targets, so every
array comes back with the sharding the step expects); ``meta`` is JSON (step, data
position, best metric so far, ...). When the newest checkpoints fail to restore (corrupt
or partially deleted files) the next older one is tried, and once one restores the failed
ones are moved aside with a warning; when none restores, nothing is moved and
`restore_latest` raises `train.errors.WorkdirError` (one line: never a silent restart from
step 0). Partial saves of a killed run are never listed (orbax writes to a temporary
directory and renames it on completion).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from train.errors import WAY_ON, WorkdirError

log = logging.getLogger(__name__)


def abstract_like(tree, shardings):
    """``jax.ShapeDtypeStruct`` targets carrying ``shardings`` (restore onto these)."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


_CPU_HANDLER_SET = False


def _cpu_array_handler() -> None:
    """On CPU, save arrays without orbax's replica-parallel slicing.

    Replica-parallel saving splits each replicated array into per-replica slices (one
    small compiled slice op per array shape): it spreads device-to-host copies over TPU
    and GPU hosts, but on (fake multi-device) CPU it only adds compilations -- several
    seconds per first save of a small model. Registered once, process-wide, CPU only.
    """
    global _CPU_HANDLER_SET
    if _CPU_HANDLER_SET or jax.default_backend() != "cpu":
        return
    absl_log = logging.getLogger("absl")
    level = absl_log.level
    absl_log.setLevel(logging.ERROR)  # orbax logs a warning for every override
    try:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True
        )
    finally:
        absl_log.setLevel(level)
    _CPU_HANDLER_SET = True


def _one_line(error: Exception) -> str:
    """``Type: first line`` of `error` (at most 300 characters)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__


class _TolerantLoop(asyncio.SelectorEventLoop):
    """An event loop that ignores callbacks scheduled after it closed: orbax closes its
    restore loop when the first array fails, and the TensorStore reads still in flight then
    schedule their completion on it (each printing ``Event loop is closed``)."""

    def call_soon_threadsafe(self, callback, *args, context=None):
        if self.is_closed():
            return None
        return super().call_soon_threadsafe(callback, *args, context=context)


class _TolerantPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self):
        return _TolerantLoop()


@contextlib.contextmanager
def _quiet_orbax(restoring: bool = False):
    """No absl (orbax, TensorStore) log records below CRITICAL while listing or restoring
    checkpoints and, `restoring`, event loops that ignore the reads a failed restore leaves
    in flight (`_TolerantLoop`): a checkpoint that does not read is reported once, in one
    line, by the caller (`Checkpointer.restore_latest`), without the library's tracebacks."""
    absl_log = logging.getLogger("absl")
    level = absl_log.level
    absl_log.setLevel(max(level, logging.CRITICAL))
    policy = asyncio.get_event_loop_policy() if restoring else None
    if restoring:
        asyncio.set_event_loop_policy(_TolerantPolicy())
    try:
        yield
    finally:
        absl_log.setLevel(level)
        if restoring:
            asyncio.set_event_loop_policy(policy)


def _layout(tree) -> dict[str, tuple]:
    """``{path: (shape, dtype)}`` of the arrays of `tree` (arrays, ShapeDtypeStructs or
    orbax array metadata)."""
    tree = getattr(tree, "item_metadata", tree)
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): (
            tuple(leaf.shape),
            str(np.dtype(leaf.dtype)),
        )
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def _check_layout(stored, abstract_state) -> None:
    """Raises ValueError naming the first arrays where the checkpoint's tree (`stored`:
    orbax metadata) and the restore target differ in path, shape or dtype: a checkpoint of
    another model is refused from its metadata, before any array is read. No metadata (None):
    nothing to compare, the restore itself decides."""
    if getattr(stored, "item_metadata", stored) is None:
        return
    have, want = _layout(stored), _layout(abstract_state)
    if have == want:
        return

    def show(entry):
        return "nothing" if entry is None else f"{entry[1]}{list(entry[0])}"

    keys = sorted(set(have) | set(want), key=lambda k: (not k.startswith("params"), k))
    diffs = [
        f"{k} {show(have.get(k))} stored, {show(want.get(k))} here"
        for k in keys
        if have.get(k) != want.get(k)
    ]
    more = f" and {len(diffs) - 1} more" if len(diffs) > 1 else ""
    raise ValueError(f"another model's arrays: {diffs[0]}{more}")


def _orphaned_read_error(error: BaseException | None) -> bool:
    """An error of a read the failed restore left in flight: orbax closes its event loop when
    the first array fails, and the TensorStore reads still running then report, through
    ``sys.unraisablehook``, the loop they cannot reach and their own read errors."""
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return True
    text = str(error)
    return isinstance(error, Exception) and (
        text.startswith("Encountered error while reading") or "tensorstore_spec" in text
    )


class _OrphanedReadFilter(logging.Filter):
    """Drops asyncio's "exception was never retrieved" records of `_orphaned_read_error`s."""

    def filter(self, record):
        return not (record.exc_info and _orphaned_read_error(record.exc_info[1]))


def _silence_orphaned_reads() -> None:
    """Installs (once) an ``unraisablehook`` and an ``asyncio`` log filter that drop the
    reports of `_orphaned_read_error` (the restore's own error says what failed) and pass
    every other one on."""
    if getattr(sys.unraisablehook, "_drops_orphaned_reads", False):
        return
    previous = sys.unraisablehook

    def hook(args):
        if not _orphaned_read_error(args.exc_value):
            previous(args)

    hook._drops_orphaned_reads = True
    sys.unraisablehook = hook
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _OrphanedReadFilter) for f in asyncio_log.filters):
        asyncio_log.addFilter(_OrphanedReadFilter())


class Checkpointer:
    """Latest + best checkpoint managers of one run.

    Args:
      workdir: the run's directory.
      max_to_keep: number of latest checkpoints kept.
      async_save: orbax asynchronous checkpointing (training continues while writing).
      best_metric: name of the eval metric that ranks best checkpoints.
      best_mode: ``"max"`` or ``"min"``.
    """

    def __init__(
        self,
        workdir: str | Path,
        *,
        max_to_keep: int = 3,
        async_save: bool = True,
        best_metric: str = "accuracy",
        best_mode: str = "max",
    ):
        if best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {best_mode!r}")
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        _cpu_array_handler()
        self.workdir = Path(workdir).absolute()
        self.best_metric = best_metric
        self.best_mode = best_mode
        self._async = async_save
        self._max_to_keep = max_to_keep
        self.latest = self._manager("checkpoints", max_to_keep)
        self.best = self._manager(
            "best",
            1,
            best_fn=lambda m: float(m[best_metric]),
            best_mode=best_mode,
            keep_checkpoints_without_metrics=False,
        )

    def _manager(self, name, max_to_keep, **kw):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=self._async,
            create=True,
            cleanup_tmp_directories=True,
            # Multi-process: the latest and best managers may save the same step at once;
            # their cross-process barriers must not share names ("already ongoing").
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                barrier_sync_key_prefix=name
            ),
            **kw,
        )
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        with _quiet_orbax():  # it reads every step's metadata
            return ocp.CheckpointManager(
                self.workdir / name, options=options, item_handlers=handlers
            )

    # ------------------------------------------------------------------ saving
    def save(self, step: int, state, meta: dict[str, Any]) -> bool:
        """Save ``state`` (a pytree) and ``meta`` (JSON) as the latest checkpoint at ``step``."""
        if step in self.latest.all_steps():
            return False
        return self.latest.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

    def save_best(self, step: int, state, meta: dict[str, Any], metrics: dict[str, float]) -> bool:
        """Offer ``state`` as the best checkpoint; kept if ``metrics[best_metric]`` is the best."""
        if step in self.best.all_steps():
            return False
        return self.best.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            metrics={k: float(v) for k, v in metrics.items()},
            force=True,
        )

    # ------------------------------------------------------------------ restoring
    def _restore(self, manager, step, abstract_state):
        _check_layout(manager.item_metadata(step)["state"], abstract_state)
        out = manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
            ),
        )
        return out["state"], dict(out["meta"])

    def _quarantine(self, manager, subdir: str, step: int, error: Exception) -> None:
        src = self.workdir / subdir / str(step)
        dst = self.workdir / f"{subdir}_corrupt" / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        msg = f"checkpoint {src} failed to restore ({_one_line(error)}); moved to {dst}"
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        log.warning(msg)
        if jax.process_index() == 0 and src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(src), str(dst))

    def restore_latest(self, abstract_state):
        """``(state, meta)`` of the newest checkpoint that restores; ``None`` if there is none.

        ``abstract_state``: a pytree of ``jax.ShapeDtypeStruct`` with shardings (see
        ``abstract_like``); every restored array gets that sharding. Newer checkpoints that
        failed to restore are then moved aside.

        Raises:
          WorkdirError: there are checkpoints but none restores (nothing is moved: no silent
            restart from step 0, now or on a rerun).
        """
        restored, failed = self._restore_newest(self.latest, abstract_state)
        if restored is None and failed:
            step, error = failed[0]
            raise WorkdirError(
                f"none of the {len(failed)} checkpoints in {self.workdir / 'checkpoints'} "
                f"restores (newest, step {step}: {_one_line(error)}); a run of another model "
                f"or damaged files: {WAY_ON}"
            )
        for step, error in failed:
            self._quarantine(self.latest, "checkpoints", step, error)
        if failed:
            with _quiet_orbax():
                self.latest.reload()
        return restored

    def restore_best(self, abstract_state):
        """``(state, meta)`` of the best checkpoint, or ``None`` (none, or none restores:
        a warning, nothing moved)."""
        restored, failed = self._restore_newest(self.best, abstract_state)
        if restored is None and failed:
            msg = f"no checkpoint in {self.workdir / 'best'} restores ({_one_line(failed[0][1])})"
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            log.warning(msg)
        return restored

    def _restore_newest(self, manager, abstract_state):
        """``(restored or None, [(step, error) of the newer ones that failed]))``."""
        failed = []
        for step in sorted(manager.all_steps(), reverse=True):
            try:
                with _quiet_orbax(restoring=True):
                    return self._restore(manager, step, abstract_state), failed
            except Exception as error:  # any failure to read: try the older one
                _silence_orphaned_reads()
                failed.append((step, error))
        return None, failed

    def wait(self) -> None:
        """Block until pending async saves are on disk."""
        self.latest.wait_until_finished()
        self.best.wait_until_finished()

    def close(self) -> None:
        self.latest.close()
        self.best.close()


__all__ = ["Checkpointer", "abstract_like"]
