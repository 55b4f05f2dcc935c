"""Teacher and student runs in the training stack: their configs, train states built from the
teacher's, the step-0 checkpoint that hands a student to the training loop, and input batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import linattn_jax as la
from train import checkpoint as ckpt_lib
from train import configs
from train import trainer as trainer_lib
from train.distill.losses import student_feature_map
from train.distill.params import trainable_mechanism_params, transplant, with_mechanism_params


def teacher_config(config):
    """`config` with softmax attention (the teacher of a distillation run)."""
    c = config.copy_and_resolve_references()
    c.attention = "softmax"
    c.attention_config = ml_collections.ConfigDict()
    return c


def student_config(config, student: str, attention_config: Mapping[str, Any] | None = None):
    """`config` with the student mechanism and `attention_config` (default: the preset's
    settings for that mechanism, `train.configs.set_attention`).

    Raises:
      ValueError: `student` has no feature map (`student_feature_map`).
    """
    c = configs.set_attention(
        config.copy_and_resolve_references(), student, like=la.origin(student)
    )
    if attention_config is not None:
        c.attention_config = ml_collections.ConfigDict(dict(attention_config))
    student_feature_map(student, c.attention_config)
    return c


def init_student(teacher_state, student_trainer):
    """A fresh student `TrainState` whose weights are the teacher's (except the mechanism
    params, which keep their init; ``fixed`` features are the student's own)."""
    state = student_trainer.init_state()
    merged, _, _ = transplant(
        trainer_lib.eval_variables(teacher_state), trainer_lib.eval_variables(state)
    )
    params = jax.device_put(merged["params"], student_trainer.state_shardings.params)
    return state.replace(params=params, opt_state=student_trainer.tx.init(params))


def with_distilled(state, trainer, feature_maps: Mapping[tuple, Any]):
    """`state` with the mechanism params of every attention layer replaced."""
    merged = with_mechanism_params(trainer_lib.eval_variables(state), feature_maps)
    params = jax.device_put(merged["params"], trainer.state_shardings.params)
    return state.replace(params=params, opt_state=trainer.tx.init(params))


def seed_checkpoint(workdir, state, config) -> None:
    """Writes `state` as the step-0 checkpoint of `workdir`, so that
    `train.loop.train_and_evaluate` starts (resumes) from it: fine-tuning reuses the loop."""
    ckpt = ckpt_lib.Checkpointer(workdir, async_save=False)
    try:
        if not ckpt.latest.all_steps():
            state = state.replace(step=jnp.zeros((), jnp.int32))
            meta = {
                "step": 0,
                "batch_size": int(config.batch_size),
                "data_shuffle_seed": int(config.data_shuffle_seed),
                "seed": int(config.seed),
                "best": None,
                "best_step": None,
            }
            ckpt.save(0, state.as_dict(), meta)
            ckpt.wait()
    finally:
        ckpt.close()


def input_batches(trainer, *, seed: int) -> Iterator[tuple]:
    """Endless model-input tuples (global sharded arrays) from the training stream."""
    keys = trainer.input_keys
    it = trainer.data.train_batches(
        int(trainer.config.batch_size),
        seed=seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    for batch in it:
        yield tuple(trainer.to_global(batch, keys)[k] for k in keys)


def eval_inputs(trainer, num_batches: int) -> list[tuple]:
    """The first `num_batches` validation batches as model-input tuples."""
    keys = trainer.input_keys
    out = []
    it = trainer.data.eval_batches(
        "val",
        int(trainer.config.eval_batch_size),
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    for i, batch in enumerate(it):
        if i >= num_batches:
            break
        out.append(tuple(trainer.to_global(batch, keys)[k] for k in keys))
    return out


def check_maps_fit(maps: Mapping[tuple, Any], state, student: str) -> None:
    """Checks that feature maps ``{path: params}`` fit the attention layers of `state`.

    Raises:
      ValueError: other layers, or other shapes, than the `student` of `state` has.
    """
    own = trainable_mechanism_params(trainer_lib.eval_variables(state))
    if set(maps) != set(own):
        raise ValueError(
            f"feature maps are for layers {sorted(maps)}, the {student!r} student has {sorted(own)}"
        )
    for p in own:
        want = jax.tree.map(lambda x: tuple(x.shape), own[p])
        got = jax.tree.map(lambda x: tuple(np.shape(x)), dict(maps[p]))
        if want != got:
            raise ValueError(f"feature maps of {p}: shapes {got}, the student needs {want}")
