"""The training loop: ``train_and_evaluate(config, workdir) -> summary``.

What one run does (everything driven by an ``ml_collections`` config, see
``train/configs/default.py``):

1. Mesh from ``config.mesh_shape``/``mesh_axes``; the workload (``WORKLOADS[config.task]``,
   `train.workloads`) builds its data and its Flax Linen model (`train.trainer.Trainer`).
2. Init via ``jax.eval_shape`` -> logical partition specs -> ``NamedSharding`` ->
   ``jax.jit(init, out_shardings=...)``: parameters and Adam moments are created already
   sharded (FSDP over ``fsdp`` via the logical-axis rules).
3. Resume from the newest checkpoint that restores (``train.checkpoint``): same step,
   same data position (the data stream is a pure function of ``(seed, batch, step)``) and
   same randomness (the step rng is ``fold_in(key, step)``, never carried state).
4. The step, ``jax.jit(train_step, in_shardings, out_shardings, donate_argnums=0)``,
   compiled ahead of time once to log its memory analysis; batches are global arrays
   split over the data axes.
5. Eval every ``eval_every`` steps (val split), best-checkpoint tracking, checkpoints every
   ``checkpoint_every`` steps, JSONL + TensorBoard + tqdm, a PNG of the curves at the end,
   and a summary (also ``workdir/summary.json``).

The steps are named functions: `restore_or_init`, `train_steps` (with `evaluate_and_track`
and the checkpoint saves), `final_evaluation`, `make_summary`, `save_summary`.

Adding a task or model
----------------------
A workload is three functions; add them to the table in ``train/workloads.py`` and give
it a config::

    def build_data(config):            # -> object with the train.data.Task batch API:
        ...                            #    train_batches(B, seed=, start_step=, num_threads=,
                                       #      process_index=, process_count=, and prefetch=
                                       #      when num_threads > 0) -> iter of dicts (the
                                       #      first batch fixes the keys/shapes/dtypes),
                                       #    eval_batches(split, B, process_index=,
                                       #      process_count=) -> iter of dicts with "mask" [B],
                                       #    input_keys (batch keys fed to the model, in order),
                                       #    splits (mapping with at least "train", "val")
    def build_model(config, data):     # -> flax.linen Module, called as
        ...                            #    model(*[batch[k] for k in data.input_keys],
                                       #          deterministic=bool) -> outputs
    def loss_fn(outputs, batch, weights, config):  # weights: float [B], 0 on eval padding
        return {"loss": (sum, count), "accuracy": (sum, count), ...}

    WORKLOADS = {..., "my_task": Workload(build_data, build_model, loss_fn)}  # workloads.py
    # config: start from train.configs.default.get_config(), set config.task = "my_task"
    # (and add a module to train.configs.CONFIGS to get `python -m train --task my_task`).

The optimiser minimises ``sum / count`` of ``"loss"``; every entry is reported as
``sum / count`` for training (per step) and evaluation (over the split). Variable
collections other than ``params`` (e.g. ``fixed`` random features, a distillation
teacher) are carried in ``TrainState.extra``: sharded, checkpointed, not optimised. The
model gets rng streams ``dropout`` and ``attention`` (``fold_in(key, step)`` split), and
``best_metric``/``best_mode`` in the config choose what ranks the best checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import resource
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from train import checkpoint as ckpt_lib
from train import guard, kernel_diagnostics
from train import metrics as metrics_lib
from train.trainer import Trainer, TrainState, count_params

log = logging.getLogger(__name__)


def _device_peak_bytes() -> int | None:
    stats = []
    for d in jax.local_devices():
        try:
            s = d.memory_stats()
        except Exception:
            s = None
        if s and "peak_bytes_in_use" in s:
            stats.append(int(s["peak_bytes_in_use"]))
    return max(stats) if stats else None


def _maxrss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def maybe_initialize_distributed(config) -> None:
    """``jax.distributed.initialize`` when ``config.distributed`` or ``$LINATTN_DISTRIBUTED=1``.

    ``config.coordinator_address`` / ``num_processes`` / ``process_id`` are passed when set
    (None: detected from the cluster environment). CPU processes exchange collectives with
    gloo (how the multi-process test runs; accelerators use their own). Never called for an
    ordinary single-process run; must run before anything touches a jax device.
    """
    if not (config.distributed or os.environ.get("LINATTN_DISTRIBUTED") == "1"):
        return
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=config.get("coordinator_address"),
        num_processes=config.get("num_processes"),
        process_id=config.get("process_id"),
    )


# ----------------------------------------------------------------------------- the loop
@dataclasses.dataclass
class RunState:
    """What the loop carries between steps: the step, the windows' metrics, the speed clock
    and the best-checkpoint record ``meta`` (``best``, ``best_step``)."""

    start: int
    step: int
    meta: dict[str, Any]
    window: list = dataclasses.field(default_factory=list)
    last_train: dict[str, float] = dataclasses.field(default_factory=dict)
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)
    timed_steps: int = 0
    timed_seconds: float = 0.0
    t_mark: float | None = None


def restore_or_init(trainer: Trainer, ckpt, config) -> tuple[TrainState, dict[str, Any], int]:
    """``(state, meta, start)``: the newest checkpoint that restores, else a fresh state."""
    restored = ckpt.restore_latest(trainer.abstract_sharded_state().as_dict())
    if restored is None:
        return trainer.init_state(), {"best": None, "best_step": None}, 0
    state_dict, meta = restored
    state = TrainState.from_dict(state_dict)
    if meta.get("batch_size") not in (None, int(config.batch_size)) or meta.get(
        "data_shuffle_seed"
    ) not in (None, int(config.data_shuffle_seed)):
        log.warning("resuming with a different batch size / data seed: the stream differs")
    return state, meta, int(jax.device_get(state.step))


def _meta_now(config, meta, step) -> dict[str, Any]:
    return {
        "step": int(step),
        "batch_size": int(config.batch_size),
        "data_shuffle_seed": int(config.data_shuffle_seed),
        "seed": int(config.seed),
        "best": meta.get("best"),
        "best_step": meta.get("best_step"),
    }


def train_batches(trainer: Trainer, config, start: int):
    """The endless global-batch stream from step `start` (this process's rows)."""
    threads = int(config.data.get("num_threads", 0))
    return trainer.data.train_batches(
        int(config.batch_size),
        seed=int(config.data_shuffle_seed),
        start_step=start,
        num_threads=threads,
        **({"prefetch": max(2, threads)} if threads else {}),  # grain: prefetch >= threads
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )


def _record_window(run: RunState) -> None:
    """Averages the window's step metrics into ``run.last_train`` and updates the speed."""
    host = jax.device_get(run.window)
    run.last_train = {k: float(np.mean([w[k] for w in host])) for k in host[0]}
    run.window = []
    if run.t_mark is not None and run.step > run.start + 1:
        now = time.time()
        run.timed_seconds += now - run.t_mark
        run.timed_steps = run.step - run.start - 1
        run.t_mark = now
    run.last_train["steps_per_sec"] = (
        run.timed_steps / run.timed_seconds if run.timed_seconds else 0.0
    )


def evaluate_and_track(trainer, state, config, run: RunState, ckpt, writer, progress) -> None:
    """Evaluates on val, logs, and saves the best checkpoint when ``best_metric`` improves."""
    run.last_eval = trainer.evaluate(state, "val", int(config.num_eval_batches))
    writer.write(run.step, "val", run.last_eval)
    better = (lambda a, b: a > b) if ckpt.best_mode == "max" else (lambda a, b: a < b)
    value = run.last_eval.get(ckpt.best_metric)
    meta = run.meta
    if value is not None and (meta.get("best") is None or better(value, meta["best"])):
        meta["best"], meta["best_step"] = float(value), run.step
        ckpt.save_best(run.step, state.as_dict(), _meta_now(config, meta, run.step), run.last_eval)
    if jax.process_index() == 0:
        progress.write(
            f"step {run.step}: val "
            + ", ".join(f"{k}={v:.4f}" for k, v in run.last_eval.items() if k != "count")
            + f" (best {ckpt.best_metric}={meta['best']} at {meta['best_step']})"
        )


def train_steps(
    trainer, state, step_fn, config, run: RunState, ckpt, writer, progress, diagnostics=None
):
    """Runs steps ``run.step .. num_train_steps`` with logging, evaluation and checkpoints;
    returns the final state. `diagnostics` (`train.kernel_diagnostics`), when given, adds
    its ``kernel/...`` entries to the logged train rows (its time counts as training time:
    it is cheap, docs/flexformer.md)."""
    num_steps = int(config.num_train_steps)
    batches = train_batches(trainer, config, run.start)
    while run.step < num_steps:
        batch = trainer.to_global(next(batches), trainer.train_keys)
        state, m = step_fn(state, batch)
        run.step += 1
        step = run.step
        run.window.append(m)
        if step == run.start + 1:
            jax.block_until_ready(m)  # the first step includes compilation/warm-up
            run.t_mark = time.time()
        log_now = step % int(config.log_every) == 0 or step == num_steps
        eval_now = step % int(config.eval_every) == 0 or step == num_steps
        ckpt_now = step % int(config.checkpoint_every) == 0 or step == num_steps
        if log_now or eval_now or ckpt_now:
            _record_window(run)
            if log_now:
                if diagnostics is not None:
                    run.last_train.update(diagnostics(state))
                writer.write(step, "train", run.last_train)
        progress.update(
            1, **{k: run.last_train[k] for k in ("loss", "accuracy") if k in run.last_train}
        )
        if eval_now:
            evaluate_and_track(trainer, state, config, run, ckpt, writer, progress)
            if run.t_mark is not None:
                run.t_mark = time.time()  # eval time is not training time
        if ckpt_now:
            ckpt.save(step, state.as_dict(), _meta_now(config, run.meta, step))
            if run.t_mark is not None:
                run.t_mark = time.time()
    ckpt.wait()
    return state


def final_evaluation(trainer, state, config, run: RunState, writer) -> dict[str, Any]:
    """``{"val", "test"}`` results: the last val (or a fresh one when nothing was trained)
    and, with ``config.eval_test``, the whole test split."""
    final = {"val": run.last_eval} if run.last_eval else {}
    if run.start >= int(config.num_train_steps):  # nothing left: evaluate the restored state
        final["val"] = trainer.evaluate(state, "val", int(config.num_eval_batches))
    splits = getattr(trainer.data, "splits", {})
    if config.eval_test and "test" in splits:
        final["test"] = trainer.evaluate(state, "test", -1)
        writer.write(run.step, "test", final["test"])
    writer.flush()
    return final


def make_summary(config, workdir, trainer, run: RunState, final, counts, mem, t_start) -> dict:
    """The run's summary dict (what `format_summary` prints and ``summary.json`` holds)."""
    n_params, n_extra = counts
    summary = {
        "task": config.task,
        "preset": config.preset,
        "attention": config.attention,
        "steps": int(run.step),
        "resumed_from": int(run.start),
        "params": n_params,
        "fixed_params": n_extra,
        "train": run.last_train,
        "val": final.get("val", {}),
        "test": final.get("test", {}),
        "best": {
            "metric": str(config.get("best_metric", "accuracy")),
            "value": run.meta.get("best"),
            "step": run.meta.get("best_step"),
        },
        "steps_per_sec": run.last_train.get("steps_per_sec"),
        "wall_seconds": time.time() - t_start,
        "memory": {
            "compiled_train_step": mem,
            "device_peak_bytes": _device_peak_bytes(),
            "host_maxrss_bytes": _maxrss_bytes(),
        },
        "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
        "mesh": {k: int(v) for k, v in trainer.mesh.shape.items()},
        "workdir": str(workdir),
    }
    previous = workdir / "summary.json"
    if not run.last_train and previous.is_file():
        # Nothing trained in this call (the run was complete): keep the speed and memory
        # that the training call measured.
        try:
            before = json.loads(previous.read_text())
            summary["steps_per_sec"] = before.get("steps_per_sec")
            summary["memory"]["compiled_train_step"] = (before.get("memory") or {}).get(
                "compiled_train_step"
            )
        except (OSError, ValueError):
            pass
    return summary


def save_summary(config, workdir: Path, summary: dict) -> None:
    """``curves.png`` (when ``config.plot``) and ``summary.json`` in `workdir` (process 0)."""
    if config.plot and (workdir / "metrics.jsonl").exists():
        try:
            metrics_lib.plot_curves(
                workdir / "metrics.jsonl",
                workdir / "curves.png",
                title=f"{config.task} / {config.attention}",
            )
            summary["plot"] = str(workdir / "curves.png")
        except Exception as e:  # a plot must never lose a finished run
            log.warning("plotting failed: %s", e)
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")


def _announce(progress, config, trainer, counts, start, mem) -> None:
    progress.write(
        f"{config.task} ({config.preset}) with {config.attention}: {counts[0]:,} params "
        f"(+{counts[1]:,} fixed), mesh {dict(trainer.mesh.shape)}, devices "
        f"{jax.device_count()} x {jax.devices()[0].platform}, "
        f"{'resuming at step ' + str(start) if start else 'from scratch'}"
    )
    if mem:
        progress.write(
            "compiled train step memory: "
            + ", ".join(f"{k}={v / 2**20:.1f}MiB" for k, v in mem.items())
        )


def train_and_evaluate(
    config, workdir: str | os.PathLike, *, data=None, restart: bool = False
) -> dict[str, Any]:
    """Train ``config`` in ``workdir`` (resuming from its checkpoints); returns the summary.

    ``data``: an already built data object (tests); default ``workload.build_data(config)``.
    Before anything is written, `train.guard` checks the settings and what ``workdir`` holds:
    a run of another config is refused (`train.errors.WorkdirError`), a finished run of this
    one returns its stored summary (``"rerun": True``; nothing trained or appended), and
    ``restart=True`` deletes the workdir's run files first and starts from step 0.
    """
    guard.check_config(config)
    workdir = Path(workdir).absolute()
    is_main = jax.process_index() == 0
    with guard.os_errors(workdir):
        done = guard.prepare_workdir(config, workdir, restart=restart, delete=is_main)
        if done is not None:
            return done
        if restart and jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("train.guard restart")
        return _train_and_evaluate(config, workdir, data, is_main)


def _train_and_evaluate(config, workdir: Path, data, is_main: bool) -> dict[str, Any]:
    t_start = time.time()
    trainer = Trainer(config, data)  # config errors raise here, before the workdir exists
    workdir.mkdir(parents=True, exist_ok=True)
    num_steps = int(config.num_train_steps)

    with contextlib.ExitStack() as stack:
        ckpt = ckpt_lib.Checkpointer(
            workdir,
            max_to_keep=int(config.max_to_keep),
            async_save=bool(config.async_checkpointing),
            best_metric=str(config.get("best_metric", "accuracy")),
            best_mode=str(config.get("best_mode", "max")),
        )
        stack.callback(ckpt.close)
        state, meta, start = restore_or_init(trainer, ckpt, config)
        if is_main:  # the run's identity (train.guard), once its checkpoints restored
            (workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
        counts = (count_params(state.params), count_params(state.extra))
        mem, step_fn = None, trainer.train_step
        if config.compile_memory_analysis and start < num_steps:
            step_fn, mem = trainer.compile_train_step()
        writer = metrics_lib.MetricsWriter(
            workdir, enabled=is_main, tensorboard=config.tensorboard, resume_step=start
        )
        stack.callback(writer.close)
        progress = metrics_lib.Progress(
            num_steps,
            start,
            enabled=is_main and bool(config.progress_bar),
            desc=f"{config.task}/{config.attention}",
        )
        if is_main:
            _announce(progress, config, trainer, counts, start, mem)
        run = RunState(start=start, step=start, meta=meta)
        # at step 0 the state is the init: not computed a second time for the diagnostics
        diagnostics = kernel_diagnostics.for_run(trainer, config, state if start == 0 else None)
        try:
            state = train_steps(
                trainer, state, step_fn, config, run, ckpt, writer, progress, diagnostics
            )
        finally:
            progress.close()
        final = final_evaluation(trainer, state, config, run, writer)

    summary = make_summary(config, workdir, trainer, run, final, counts, mem, t_start)
    if diagnostics is not None:
        diagnostics(state)  # the end values of the state the run ends with
        summary["kernel"] = diagnostics.summary()
    if is_main:
        save_summary(config, workdir, summary)
        if diagnostics is not None and config.plot:
            _plot_kernel(config, workdir, summary)
    return summary


def _plot_kernel(config, workdir: Path, summary: dict) -> None:
    try:
        png = kernel_diagnostics.plot_kernel(
            workdir / "metrics.jsonl", workdir / "kernel.png", title=f"{config.attention} kernel"
        )
    except Exception as e:  # a plot must never lose a finished run
        log.warning("kernel plot failed: %s", e)
        return
    if png is not None:
        summary["kernel_plot"] = str(png)
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")


def format_summary(summary: Mapping[str, Any]) -> str:
    """A human-readable summary (what ``python -m train`` prints at the end)."""

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.2f}%"

    val, test = summary.get("val", {}), summary.get("test", {})
    rerun = bool(summary.get("rerun"))
    lines = [
        f"== {summary['task']} ({summary['preset']}) / attention={summary['attention']} ==",
        *(["finished earlier: its stored summary (nothing trained or appended)"] * rerun),
        f"steps: {summary['steps']}"
        + (f" (resumed from {summary['resumed_from']})" if summary["resumed_from"] else "")
        + f", params: {summary['params']:,} trainable + {summary['fixed_params']:,} fixed",
    ]
    if summary["train"]:
        lines.append(
            f"train (last window): loss {summary['train'].get('loss', float('nan')):.4f}, "
            f"accuracy {pct(summary['train'].get('accuracy'))}"
        )
    else:
        lines.append("train: nothing left to train (the run was already complete)")
    for name, res in (("val", val), ("test", test)):
        if res:
            lines.append(
                f"{name}: accuracy {pct(res.get('accuracy'))} vs majority-class baseline "
                f"{pct(res.get('majority'))} (loss {res.get('loss', float('nan')):.4f}, "
                f"{int(res.get('count', 0))} examples)"
            )
    best = summary.get("best", {})
    if best.get("value") is not None:
        lines.append(f"best val {best['metric']}: {best['value']:.4f} at step {best['step']}")
    sps = summary.get("steps_per_sec")
    lines.append(
        f"speed: {sps:.2f} steps/s (excluding compilation and eval), wall "
        f"{summary['wall_seconds']:.1f}s on {summary['devices']}, mesh {summary['mesh']}"
        if sps
        else f"wall {summary['wall_seconds']:.1f}s on {summary['devices']}"
    )
    mem = summary.get("memory", {})
    parts = []
    if mem.get("device_peak_bytes"):
        parts.append(f"device peak {mem['device_peak_bytes'] / 2**20:.1f} MiB (memory_stats)")
    if mem.get("compiled_train_step"):
        parts.append(
            f"train step {mem['compiled_train_step']['estimated_peak_bytes'] / 2**20:.1f} MiB "
            "(compiled memory_analysis: args + outputs - aliased + temps)"
        )
    parts.append(f"host max RSS {mem.get('host_maxrss_bytes', 0) / 2**20:.0f} MiB (getrusage)")
    lines.append("memory: " + "; ".join(parts))
    kernel = kernel_diagnostics.format_line(summary)
    if kernel:
        lines.append(kernel)
    lines.append(
        f"workdir: {summary['workdir']}"
        + (f", plot {summary['plot']}" if summary.get("plot") else "")
    )
    return "\n".join(lines)


__all__ = [
    "evaluate_and_track",
    "final_evaluation",
    "format_summary",
    "make_summary",
    "maybe_initialize_distributed",
    "restore_or_init",
    "save_summary",
    "train_batches",
    "train_and_evaluate",
    "train_steps",
    "RunState",
]
