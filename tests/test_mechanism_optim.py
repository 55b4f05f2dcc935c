"""Per-group optimisation: the attention mechanisms' params get ``mechanism_lr_mult`` times
the learning rate and their own ``mechanism_weight_decay``, sharded and across a resume."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import tiny_config, toy_task

from train import checkpoint as ckpt_lib
from train import trainer as trainer_lib
from train.trainer import Trainer, TrainState

MULT = 4.0


def _config(mult):
    c = tiny_config("flexformer_n", num_features=4)
    c.update(schedule="constant", warmup_steps=0, grad_clip_norm=None, mechanism_lr_mult=mult)
    c.mesh_shape = (4, 2)  # data and fsdp both split
    return c


def _step(trainer, task, state, step):
    keys = (*trainer.input_keys, "targets")
    batch = trainer.to_global(task.train_batch(step, 16, seed=0), keys)
    return trainer.train_step(state, batch)


def _deltas(state, init):
    return jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), state.params, init.params)


def test_lr_mult_scales_mechanism_updates_and_resumes_exactly(tmp_path):
    """Adam's first update is ``lr * g / (|g| + eps)``: with the multiplier, every mechanism
    param moves exactly ``mechanism_lr_mult`` times as far, every other param exactly as
    far, on a (4, 2) mesh. A checkpoint of the multi-group optimizer state restores
    bitwise and the resumed steps equal the uninterrupted ones."""
    task = toy_task()
    moved = {}
    for mult in (1.0, MULT):
        trainer = Trainer(_config(mult), task, devices=jax.devices()[:8])
        init = jax.device_get(trainer.init_state())
        state, _ = _step(trainer, task, trainer.init_state(), 0)
        moved[mult] = _deltas(jax.device_get(state), init)
    labels = jax.tree.leaves(trainer_lib.mechanism_mask(moved[1.0]))
    assert sum(labels) == 2 * 3 and not all(labels)  # omega1, omega2, tau in 2 layers
    for is_mech, a, b in zip(
        labels, jax.tree.leaves(moved[1.0]), jax.tree.leaves(moved[MULT]), strict=True
    ):
        assert np.abs(a).max() > 0
        if is_mech:
            np.testing.assert_allclose(b, MULT * a, rtol=1e-4, atol=1e-9)
        else:
            np.testing.assert_array_equal(b, a)
    # resume: save after 2 steps, restore into the sharded target, 2 more steps
    state = trainer.init_state()
    for step in range(2):
        state, _ = _step(trainer, task, state, step)
    ck = ckpt_lib.Checkpointer(tmp_path, async_save=False)
    ck.save(2, state.as_dict(), {"step": 2})
    restored, _ = ck.restore_latest(trainer.abstract_sharded_state().as_dict())
    ck.close()
    restored = TrainState.from_dict(restored)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), jax.device_get(state))
    for step in (2, 3):
        state, m_ref = _step(trainer, task, state, step)
        restored, m_res = _step(trainer, task, restored, step)
        assert float(m_res["loss"]) == float(m_ref["loss"])
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), jax.device_get(state))


def test_mechanism_weight_decay_and_groups():
    """With zero gradients the update is ``-lr * mult * wd_mech * p`` on every mechanism leaf
    (any rank) and ``-lr * wd * p`` on the other decayed leaves; the group is read off a path
    component named ``mechanism`` wherever it sits. Bad values raise."""
    c = _config(3.0)
    c.update(weight_decay=0.1, mechanism_weight_decay=0.5, learning_rate=1e-2)
    params = {
        "block": {
            "attention": {"mechanism": {"tau": jnp.ones(2), "omega": jnp.ones((2, 3, 4))}},
            "dense": {"kernel": jnp.ones((4, 4)), "bias": jnp.ones(4)},
        },
        "other_mechanism": {"w": jnp.ones((2, 2))},  # not a component named "mechanism"
    }
    tx, _ = trainer_lib.make_optimizer(c)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    mech = updates["block"]["attention"]["mechanism"]
    for leaf in jax.tree.leaves(mech):
        np.testing.assert_allclose(leaf, -1e-2 * 3.0 * 0.5, rtol=1e-6)
    np.testing.assert_allclose(updates["block"]["dense"]["kernel"], -1e-2 * 0.1, rtol=1e-6)
    np.testing.assert_array_equal(updates["block"]["dense"]["bias"], 0.0)
    np.testing.assert_allclose(updates["other_mechanism"]["w"], -1e-2 * 0.1, rtol=1e-6)
    for key, bad in (("mechanism_lr_mult", 0.0), ("mechanism_weight_decay", -0.1)):
        c2 = c.copy_and_resolve_references()
        c2[key] = bad
        with pytest.raises(ValueError, match=key):
            trainer_lib.make_optimizer(c2)
