"""Training on a (data, seq) mesh: the causal LM's attention runs sequence-parallel over the
``seq`` axis and matches the one-device run; checkpoints round-trip; bad meshes
raise clear errors."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from test_train import tiny_config, toy_task

from train import checkpoint as ckpt_lib
from train import configs
from train.trainer import Trainer, TrainState


def _lm_config(attention="linear_elu", seq_len=32, **attention_config):
    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if not path.is_file():
        pytest.skip("no LICENSE.txt in this Python's stdlib")
    c = configs.get_config("lm", "mini")
    c.attention = attention
    c.attention_config = attention_config
    c.data.update(path=str(path), seq_len=seq_len, val_fraction=0.1)
    c.model.update(num_layers=1, emb_dim=16, num_heads=2, qkv_dim=16, mlp_dim=32)
    c.update(batch_size=4, eval_batch_size=4, learning_rate=3e-3, warmup_steps=1)
    c.compile_memory_analysis = False
    return c


def _seq_mesh(c, shape=(2, 4)):
    c.mesh_axes = ("data", "seq")
    c.mesh_shape = shape
    return c


def _steps(trainer, n=2):
    state = trainer.init_state()
    batches = trainer.data.train_batches(int(trainer.config.batch_size), seed=0)
    losses = []
    for _ in range(n):
        state, metrics = trainer.train_step(state, trainer.to_global(next(batches)))
        losses.append(float(metrics["loss"]))
    return state, losses


# Sums over the sequence are reduced across 4 devices in another order: rtol 1e-5.
def test_lm_on_a_data_seq_mesh_matches_one_device(tmp_path):
    one = Trainer(_lm_config(), devices=jax.devices()[:1])
    want_state, want = _steps(one)
    assert want[1] != want[0]
    trainer = Trainer(_seq_mesh(_lm_config()), devices=jax.devices()[:8])
    assert dict(trainer.mesh.shape) == {"data": 2, "seq": 4}
    step = jax.make_jaxpr(trainer._train_step)(
        trainer.abstract_sharded_state(), trainer.batch_spec()
    )
    assert "shard_map" in str(step)  # the attention runs sequence-parallel
    assert trainer.input_shardings["inputs"].spec == PartitionSpec(("data",), "seq")
    # params replicated over seq (the "fsdp" rule is dropped: the mesh has no such axis)
    specs = [s.spec for s in jax.tree.leaves(trainer.state_shardings.params)]
    assert all(e is None for spec in specs for e in spec), specs
    state, got = _steps(trainer)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
        jax.device_get(state.params),
        jax.device_get(want_state.params),
    )
    # the tokens and the attention are split over seq: 32 / 4 tokens per device
    batch = trainer.to_global(next(trainer.data.train_batches(4, seed=0)))
    assert batch["inputs"].sharding.shard_shape((4, 32)) == (2, 8)
    assert trainer.evaluate(state, "val", num_batches=1)["loss"] == pytest.approx(
        one.evaluate(want_state, "val", num_batches=1)["loss"], rel=1e-5
    )
    # checkpoint on the seq mesh: restored bitwise with the same shardings
    ck = ckpt_lib.Checkpointer(tmp_path, async_save=False)
    ck.save(2, state.as_dict(), {"step": 2})
    restored, _ = ck.restore_latest(trainer.abstract_sharded_state().as_dict())
    ck.close()
    restored = TrainState.from_dict(restored)
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert x.sharding == y.sharding


def test_lra_encoder_with_cls_on_a_seq_mesh_matches_one_device():
    # CLS + 31 tokens = 32 attention positions, 8 per device
    task = toy_task(seq_len=31)
    losses = []
    for mesh, devices in ((None, 1), ((2, 4), 8)):
        c = tiny_config("linear_elu")
        if mesh:
            _seq_mesh(c, mesh)
        trainer = Trainer(c, task, devices=jax.devices()[:devices])
        state = trainer.init_state()
        batch = task.train_batch(0, c.batch_size, seed=0)
        _, metrics = trainer.train_step(state, trainer.to_global(batch, ("inputs", "targets")))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


def test_seq_mesh_errors():
    with pytest.raises(ValueError, match=r"seq_len, \+ 1 with a CLS token\) must divide by 4"):
        Trainer(_seq_mesh(_lm_config(seq_len=30)), devices=jax.devices()[:8])
    with pytest.raises(ValueError, match=r"attention='softmax' does not run sequence-parallel"):
        Trainer(_seq_mesh(_lm_config("softmax")), devices=jax.devices()[:8])
    c = _seq_mesh(_lm_config())
    c.data_axes = ("data", "seq")
    with pytest.raises(ValueError, match=r"data_axes \('data', 'seq'\) must not contain"):
        Trainer(c, devices=jax.devices()[:8])
