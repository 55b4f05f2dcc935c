"""Orbax checkpoints: the latest N for resumption, and the best one by an eval metric.

Layout under the work directory::

    checkpoints/<step>/{state,meta}   latest ``max_to_keep`` (async saves)
    best/<step>/{state,meta}          the single best by ``best_metric`` (``best_mode``)
    checkpoints_corrupt/<step>-<time> checkpoints that failed to restore, moved aside

``state`` is the train state pytree (restored onto abstract, sharded targets, so every
array comes back with the sharding the step expects); ``meta`` is JSON (step, data
position, best metric so far, ...). A checkpoint that fails to restore (corrupt or
partially deleted files) is moved aside with a warning and the next older one is tried;
partial saves of a killed run are never listed (orbax writes to a temporary directory and
renames it on completion).
"""

from __future__ import annotations

import logging
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

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
        return ocp.CheckpointManager(self.workdir / name, options=options)

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
        msg = (
            f"checkpoint {src} failed to restore ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:200] if str(error) else ''}); moved to {dst}, "
            "trying the previous one"
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        log.warning(msg)
        if jax.process_index() == 0 and src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(src), str(dst))
        manager.reload()

    def restore_latest(self, abstract_state):
        """``(state, meta)`` of the newest checkpoint that restores, or ``None`` if none does.

        ``abstract_state``: a pytree of ``jax.ShapeDtypeStruct`` with shardings (see
        ``abstract_like``); every restored array gets that sharding.
        """
        return self._restore_newest(self.latest, "checkpoints", abstract_state)

    def restore_best(self, abstract_state):
        """``(state, meta)`` of the best checkpoint, or ``None``."""
        return self._restore_newest(self.best, "best", abstract_state)

    def _restore_newest(self, manager, subdir, abstract_state):
        for step in sorted(manager.all_steps(), reverse=True):
            try:
                return self._restore(manager, step, abstract_state)
            except Exception as error:  # any failure to read: quarantine, try older
                self._quarantine(manager, subdir, step, error)
        return None

    def wait(self) -> None:
        """Block until pending async saves are on disk."""
        self.latest.wait_until_finished()
        self.best.wait_until_finished()

    def close(self) -> None:
        self.latest.close()
        self.best.close()


__all__ = ["Checkpointer", "abstract_like"]
