"""The two stages of distillation and the runs built on them.

1. **Attention matching** (`distill_attention`). The student is the teacher's architecture
   with a feature-map mechanism (``la.get(name).feature_map`` is not None), initialised from
   the teacher's weights. Only the feature-map parameters are trained, on the *teacher's*
   queries and keys (captured from the teacher's forward pass), to minimise the attention KL
   (`train.distill.losses`). Performer (and rfa's fixed features) have nothing to learn
   here: stage 1 only measures them.
2. **Fine-tuning.** The whole student is trained on the task by the training loop
   (`train.loop.train_and_evaluate`), starting from the distilled parameters.

`distill` runs both (and, with ``baselines``, the same student without stage 1 and from
scratch); `kernel_transfer` copies feature maps distilled on task A into the student of task B.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from train import guard, loop
from train import metrics as metrics_lib
from train import trainer as trainer_lib
from train.distill.capture import capture_attention
from train.distill.losses import matching_loss, student_feature_map
from train.distill.params import (
    load_feature_maps,
    mechanism_params,
    save_feature_maps,
    trainable_mechanism_params,
)
from train.distill.states import (
    check_maps_fit,
    eval_inputs,
    init_student,
    input_batches,
    seed_checkpoint,
    teacher_config,
    with_distilled,
)


@dataclasses.dataclass
class Stage1Result:
    """Distilled mechanism params and the matching-loss history.

    ``params``: ``{path: trainable mechanism params}``; ``history``: ``[(step, loss)]``;
    ``initial_loss`` / ``final_loss``: the mean KL on the evaluation batches before and
    after; ``per_layer``: final KL per attention call.
    """

    params: dict
    history: list
    initial_loss: float
    final_loss: float
    per_layer: list


def distill_attention(
    teacher: nn.Module,
    teacher_variables,
    student_name: str,
    student_variables,
    batches: Iterable[tuple],
    *,
    num_steps: int,
    learning_rate: float = 1e-2,
    block_size: int = 128,
    eval_inputs: Iterable[tuple] = (),
    log_every: int = 0,
    progress: Callable[[int, float], None] | None = None,
) -> Stage1Result:
    """Stage 1: trains the student's feature-map params to match the teacher's attention.

    Args:
      teacher: the trained softmax model.
      teacher_variables: the teacher's variables.
      student_name: the student's mechanism (one of `distillable_names`); its config is bound in
        the student model, the params come from `student_variables`.
      student_variables: the student's variables (for the fixed features and the initial
        feature-map params; its other weights are irrelevant here).
      batches: iterator of model-input tuples (e.g. ``(batch["inputs"],)``).
      num_steps: optimiser steps (Adam at `learning_rate`, cosine decay).
      block_size: query rows per block of the loss.
      eval_inputs: input tuples on which the initial and final loss are measured
        (default: the first training batch).
      progress: called as ``progress(step, loss)`` every `log_every` steps.
    """
    student_feature_map(student_name)
    all_params = mechanism_params(student_variables)
    trainable = trainable_mechanism_params(student_variables)
    fixed = {
        p: {k: v for k, v in all_params[p].items() if k not in trainable[p]} for p in all_params
    }
    schedule = optax.cosine_decay_schedule(learning_rate, max(num_steps, 1))
    tx = optax.adam(schedule)
    opt_state = tx.init(trainable)
    # the optimiser's step counts on the params' mesh, as `step` returns them (else the
    # second step compiles again for the new placement)
    named = [
        x.sharding for x in jax.tree.leaves(trainable) if isinstance(x.sharding, NamedSharding)
    ]
    if named:
        replicated = NamedSharding(named[0].mesh, PartitionSpec())
        opt_state = jax.tree.map(
            lambda x: jax.device_put(x, replicated) if jnp.ndim(x) == 0 else x, opt_state
        )

    def loss_of(params, fixed, teacher_vars, inputs):
        # the teacher's q, k are captured inside the same jit: paths and flags are static;
        # arrays are arguments, never closed over (see `train.lm.init_cache`)
        calls = capture_attention(teacher, teacher_vars, *inputs, deterministic=True)
        merged = {p: {**fixed.get(p, {}), **params.get(p, {})} for p in {c.path for c in calls}}
        return matching_loss(calls, merged, student_name, block_size=block_size)

    @jax.jit
    def step(params, opt_state, fixed, teacher_vars, inputs):
        grad_fn = jax.value_and_grad(loss_of, has_aux=True)
        (loss, _), grads = grad_fn(params, fixed, teacher_vars, inputs)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    evaluate = jax.jit(loss_of)
    it = iter(batches)
    eval_inputs = [tuple(x) for x in eval_inputs]
    first = None
    if not eval_inputs:
        first = tuple(next(it))
        eval_inputs = [first]

    def eval_loss(params):
        losses, layers = [], []
        for inputs in eval_inputs:
            loss, per = evaluate(params, fixed, teacher_variables, inputs)
            losses.append(float(loss))
            layers.append([float(x) for x in per])
        return float(np.mean(losses)), np.mean(np.asarray(layers), axis=0).tolist()

    initial, _ = eval_loss(trainable)
    history = []
    params = trainable
    for i in range(num_steps):
        inputs = first if (i == 0 and first is not None) else tuple(next(it))
        params, opt_state, loss = step(params, opt_state, fixed, teacher_variables, inputs)
        if log_every and ((i + 1) % log_every == 0 or i + 1 == num_steps):
            history.append((i + 1, float(loss)))
            if progress is not None:
                progress(i + 1, float(loss))
    final, per_layer = eval_loss(params)
    return Stage1Result(params, history, initial, final, per_layer)


def _log(msg: str) -> None:
    print(msg, flush=True)


def _prepare(workdir, teacher_workdir, restart: bool) -> Path:
    """`workdir` made absolute and created; with `restart`, the run files of every training
    run under it (stage 2, the baselines, transfer's fine-tunes: the subdirectories holding
    any of `train.guard.RUN_FILES`, a seeded step-0 checkpoint included) deleted first
    (`train.guard.restart_workdir`), never the teacher's."""
    workdir = Path(workdir).absolute()
    if restart and workdir.is_dir():
        teacher = Path(teacher_workdir).absolute()
        if teacher == workdir or workdir in teacher.parents:
            raise ValueError(
                f"restart would delete the teacher's run: teacher_workdir {teacher} is inside "
                f"workdir {workdir}; give the distillation a workdir of its own"
            )
        for child in sorted(workdir.iterdir()):
            if child.is_dir() and any((child / f).exists() for f in guard.RUN_FILES):
                guard.restart_workdir(child)
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir


def distill(
    config,
    *,
    teacher_workdir,
    workdir,
    stage1_steps: int = 300,
    stage1_lr: float = 1e-2,
    block_size: int = 128,
    num_eval_batches: int = 2,
    stage2: bool = True,
    stage2_lr: float | None = None,
    baselines: bool = False,
    train_teacher: bool = False,
    restart: bool = False,
    data=None,
    log: Callable[[str], None] = _log,
) -> dict[str, Any]:
    """Distils the softmax teacher of `config` into ``config.attention`` (the student).

    Stage 1 (`distill_attention`) for `stage1_steps`, then stage 2: the loop
    (`train.loop.train_and_evaluate`) fine-tunes the whole student for
    ``config.num_train_steps`` at `stage2_lr` (default ``config.learning_rate``; a distilled
    student wants a smaller one than training from scratch -- on the test task 1e-3 undid
    stage 1 for flexformer_n, 1e-4 kept it) in ``workdir/stage2``, seeded with the distilled
    student as its step-0 checkpoint. With `baselines`, the same student is also fine-tuned
    the same way from the teacher's weights without stage 1 (``workdir/no_stage1``), and
    trained from scratch for ``stage1_steps + num_train_steps`` steps at
    ``config.learning_rate`` (``workdir/scratch``).

    A rerun in the same `workdir` resumes its training runs, and one of another config is
    refused (`train.guard`) unless `restart` deletes them first (`_prepare`).

    Writes ``workdir/feature_maps.msgpack`` (the distilled maps, for `kernel_transfer`) and
    ``workdir/distill_summary.json``; returns the summary.
    """
    workdir = _prepare(workdir, teacher_workdir, restart)
    student = config.attention
    student_feature_map(student, config.attention_config)
    t_trainer, t_state = _teacher(config, teacher_workdir, train_teacher, data, log)
    t_start = time.time()  # the teacher's time is in its own run's summary
    data = t_trainer.data
    teacher_val = t_trainer.evaluate(t_state, "val")
    log(f"teacher (softmax) val: {_fmt(teacher_val)}")

    s_trainer = trainer_lib.Trainer(config, data)
    s_state = init_student(t_state, s_trainer)
    no_stage1_val = s_trainer.evaluate(s_state, "val")
    log(f"student {student} with the teacher's weights, before stage 1: {_fmt(no_stage1_val)}")
    writer = _writer(workdir, config)
    progress = _progress(stage1_steps, f"stage 1 ({student})", config)

    def on_step(step, loss):
        writer.write(step, "stage1", {"attention_kl": loss})
        progress.update(0, attention_kl=loss)

    def tick():
        for x in input_batches(s_trainer, seed=int(config.data_shuffle_seed) + 1):
            progress.update(1)
            yield x

    try:
        result = distill_attention(
            t_trainer.model,
            trainer_lib.eval_variables(t_state),
            student,
            trainer_lib.eval_variables(s_state),
            tick(),
            num_steps=stage1_steps,
            learning_rate=stage1_lr,
            block_size=block_size,
            eval_inputs=eval_inputs(s_trainer, num_eval_batches),
            log_every=max(1, int(config.log_every)),
            progress=on_step,
        )
    finally:
        progress.close()
    log(
        f"stage 1: attention KL {result.initial_loss:.4f} -> {result.final_loss:.4f} "
        f"(per layer {', '.join(f'{x:.4f}' for x in result.per_layer)})"
    )
    save_feature_maps(
        workdir / "feature_maps.msgpack",
        result.params,
        {"task": config.task, "student": student, "attention_config": _pairs(config)},
    )
    d_state = with_distilled(s_state, s_trainer, result.params)
    zero_shot = s_trainer.evaluate(d_state, "val")
    log(f"student after stage 1 (no fine-tuning) val: {_fmt(zero_shot)}")
    summary: dict[str, Any] = {
        "task": config.task,
        "preset": config.preset,
        "student": student,
        "attention_config": _pairs(config),
        "teacher_val": teacher_val,
        "student_before_stage1_val": no_stage1_val,
        "stage2_learning_rate": float(stage2_lr or config.learning_rate),
        "stage1": {
            "steps": stage1_steps,
            "learning_rate": stage1_lr,
            "initial_kl": result.initial_loss,
            "final_kl": result.final_loss,
            "per_layer_kl": result.per_layer,
            "history": result.history,
        },
        "after_stage1_val": zero_shot,
    }
    metric = str(config.get("best_metric", "accuracy"))
    _stage2_and_baselines(
        config, workdir, data, d_state, t_state, s_trainer, summary,
        stage1_steps=stage1_steps, stage2=stage2, stage2_lr=stage2_lr, baselines=baselines,
        log=log,
    )  # fmt: skip
    final = summary.get("stage2", {}).get("val") or zero_shot
    if metric in final and teacher_val.get(metric):
        summary["recovery"] = final[metric] / teacher_val[metric]
    writer.close()
    summary["wall_seconds"] = time.time() - t_start
    (workdir / "distill_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _stage2_and_baselines(
    config, workdir, data, d_state, t_state, s_trainer, summary, *, stage1_steps, stage2,
    stage2_lr, baselines, log,
):  # fmt: skip
    """`distill`'s stage 2 from the distilled student `d_state` and, with `baselines`, the
    two baselines (no stage 1; from scratch); their results go into `summary`."""
    s2_config = config.copy_and_resolve_references()
    if stage2_lr is not None:
        s2_config.learning_rate = float(stage2_lr)
    if stage2:
        seed_checkpoint(workdir / "stage2", d_state, s2_config)
        s2 = loop.train_and_evaluate(s2_config, workdir / "stage2", data=data)
        summary["stage2"] = {"steps": s2["steps"], "val": s2["val"], "test": s2["test"]}
        log(f"stage 2 ({s2['steps']} steps) val: {_fmt(s2['val'])}")
    if baselines:
        no_stage1 = init_student(t_state, s_trainer)
        seed_checkpoint(workdir / "no_stage1", no_stage1, s2_config)
        b1 = loop.train_and_evaluate(s2_config, workdir / "no_stage1", data=data)
        scratch_cfg = config.copy_and_resolve_references()
        scratch_cfg.num_train_steps = int(config.num_train_steps) + stage1_steps
        b2 = loop.train_and_evaluate(scratch_cfg, workdir / "scratch", data=data)
        summary["baselines"] = {
            "no_stage1": {"steps": b1["steps"], "val": b1["val"]},
            "scratch": {"steps": b2["steps"], "val": b2["val"]},
        }
        log(f"baseline, teacher weights without stage 1: {_fmt(b1['val'])}")
        log(f"baseline, from scratch ({b2['steps']} steps): {_fmt(b2['val'])}")


def kernel_transfer(
    config,
    *,
    teacher_workdir,
    source,
    workdir,
    own=None,
    stage1_steps: int = 300,
    stage1_lr: float = 1e-2,
    block_size: int = 128,
    num_eval_batches: int = 2,
    finetune: bool = False,
    train_teacher: bool = False,
    restart: bool = False,
    data=None,
    log: Callable[[str], None] = _log,
) -> dict[str, Any]:
    """Feature maps distilled on task A (`source`, a ``feature_maps.msgpack``) used on task B.

    Task B is `config` (student mechanism ``config.attention``, teacher in
    `teacher_workdir`). Compares three sets of maps in B's student (all other weights the
    B teacher's): ``own`` (distilled on B: the file `own`, or a fresh stage 1 of
    `stage1_steps`), ``transferred`` (from A) and ``init`` (untrained). For each: the
    attention-matching KL on B's validation batches and B's validation metric without
    fine-tuning; with `finetune`, also after ``config.num_train_steps`` steps of stage 2.
    ``drop`` = own - transferred (metric; positive = transfer loses). With `train_teacher`,
    B's teacher is trained in `teacher_workdir` first if it has no checkpoint.
    `restart` as in `distill`.
    """
    workdir = _prepare(workdir, teacher_workdir, restart)
    student = config.attention
    student_feature_map(student, config.attention_config)
    src_maps, src_info = load_feature_maps(source)  # before any training: fail fast
    if src_info.get("student") not in (None, student):
        raise ValueError(f"{source} holds {src_info['student']!r} maps, not {student!r}")
    t_trainer, t_state = _teacher(config, teacher_workdir, train_teacher, data, log)
    t_start = time.time()  # the teacher's time is in its own run's summary
    data = t_trainer.data
    s_trainer = trainer_lib.Trainer(config, data)
    base = init_student(t_state, s_trainer)
    check_maps_fit(src_maps, base, student)
    if own is not None:
        own_maps, _ = load_feature_maps(own)
        check_maps_fit(own_maps, base, student)
    else:
        own_maps = distill_attention(
            t_trainer.model,
            trainer_lib.eval_variables(t_state),
            student,
            trainer_lib.eval_variables(base),
            input_batches(s_trainer, seed=int(config.data_shuffle_seed) + 1),
            num_steps=stage1_steps,
            learning_rate=stage1_lr,
            block_size=block_size,
        ).params
    variants = {
        "own": own_maps,
        "transferred": src_maps,
        "init": trainable_mechanism_params(trainer_lib.eval_variables(base)),
    }
    ev = eval_inputs(s_trainer, num_eval_batches)
    t_vars = trainer_lib.eval_variables(t_state)

    @jax.jit
    def kl(maps, fixed, t_vars, inputs):
        calls = capture_attention(t_trainer.model, t_vars, *inputs, deterministic=True)
        merged = {p: {**fixed[p], **maps[p]} for p in maps}
        return matching_loss(calls, merged, student, block_size=block_size)[0]

    fixed = mechanism_params(trainer_lib.eval_variables(base))

    metric = str(config.get("best_metric", "accuracy"))
    summary: dict[str, Any] = {
        "task": config.task,
        "student": student,
        "source": str(source),
        "source_task": src_info.get("task"),
        "teacher_val": t_trainer.evaluate(t_state, "val"),
    }
    for name, maps in variants.items():
        maps = jax.tree.map(jnp.asarray, maps)
        state = with_distilled(base, s_trainer, maps)
        row = {
            "attention_kl": float(np.mean([float(kl(maps, fixed, t_vars, x)) for x in ev])),
            "val": s_trainer.evaluate(state, "val"),
        }
        if finetune:
            seed_checkpoint(workdir / name, state, config)
            row["finetuned_val"] = loop.train_and_evaluate(config, workdir / name, data=data)["val"]
        summary[name] = row
        log(f"{name:12s} maps: attention KL {row['attention_kl']:.4f}, val {_fmt(row['val'])}")
    key = "finetuned_val" if finetune else "val"
    if metric in summary["own"][key]:
        summary["drop"] = summary["own"][key][metric] - summary["transferred"][key][metric]
        log(f"transfer drop ({metric}, own - transferred): {summary['drop']:+.4f}")
    summary["wall_seconds"] = time.time() - t_start
    (workdir / "transfer_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _teacher(config, teacher_workdir, train_teacher: bool, data, log):
    """``(trainer, state)`` of the softmax teacher of `config`, trained first if asked."""
    t_cfg = teacher_config(config)
    if train_teacher and not _has_checkpoint(teacher_workdir):
        log(f"training the softmax teacher in {teacher_workdir}")
        loop.train_and_evaluate(t_cfg, teacher_workdir, data=data)
    t_trainer, t_state, _ = trainer_lib.restore_run(t_cfg, teacher_workdir, data=data)
    return t_trainer, t_state


def _has_checkpoint(workdir) -> bool:
    root = Path(workdir)
    return any(
        (root / sub).is_dir() and any((root / sub).iterdir()) for sub in ("best", "checkpoints")
    )


def _pairs(config) -> list:
    raw = config.attention_config
    raw = raw.to_dict() if hasattr(raw, "to_dict") else dict(raw or {})
    return sorted(raw.items())


def _fmt(metrics: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k != "count")


def _writer(workdir, config):
    return metrics_lib.MetricsWriter(
        workdir, enabled=jax.process_index() == 0, tensorboard=bool(config.tensorboard)
    )


def _progress(total, desc, config):
    return metrics_lib.Progress(
        total, enabled=jax.process_index() == 0 and bool(config.progress_bar), desc=desc
    )


def format_summary(summary: Mapping[str, Any]) -> str:
    """What ``python -m train.distill run`` prints at the end."""
    s1 = summary["stage1"]
    metric = "accuracy"

    def m(res):
        return "n/a" if not res or metric not in res else f"{res[metric]:.4f}"

    lines = [
        f"== distillation: {summary['task']} ({summary['preset']}), softmax -> "
        f"{summary['student']} {summary['attention_config']} ==",
        f"teacher val {metric}: {m(summary['teacher_val'])}",
        "student with the teacher's weights, no stage 1: "
        f"{m(summary['student_before_stage1_val'])}",
        f"stage 1 ({s1['steps']} steps): attention KL {s1['initial_kl']:.4f} -> "
        f"{s1['final_kl']:.4f}; val {metric} after stage 1: {m(summary['after_stage1_val'])}",
    ]
    if "stage2" in summary:
        lines.append(
            f"stage 2 ({summary['stage2']['steps']} steps): val {metric} "
            f"{m(summary['stage2']['val'])}, test {m(summary['stage2']['test'])}"
        )
    if "baselines" in summary:
        b = summary["baselines"]
        lines.append(
            f"baselines (same student): teacher weights without stage 1 "
            f"({b['no_stage1']['steps']} steps) {m(b['no_stage1']['val'])}, from scratch "
            f"({b['scratch']['steps']} steps) {m(b['scratch']['val'])}"
        )
    if "recovery" in summary:
        lines.append(f"recovered {100 * summary['recovery']:.1f}% of the teacher's {metric}")
    return "\n".join(lines)
