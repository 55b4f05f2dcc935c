"""Kernel diagnostics while training (train/kernel_diagnostics.py): the ``kernel/...``
entries, their values on known params, and their place in a run (metrics, plot, summary)."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from test_train import tiny_config, toy_task

from train import kernel_diagnostics as kd
from train import loop
from train.distill.capture import capture_attention
from train.trainer import Trainer

KEYS = {
    "freq_norm_ratio",
    "freq_move",
    "attn_tv",
    "scale_ratio",
    "neg_weight_frac",
    "entropy_ratio",
    "shift_gap",
}


def test_weight_stats_on_known_rows():
    """Uniform rows have entropy ratio 1, one-hot rows 0; invisible pairs and rows with one
    visible key are left out; the negative share counts visible pairs only."""
    w = jnp.array(
        [
            [0.25, 0.25, 0.25, 0.25],  # uniform: 1
            [1.0, 0.0, 0.0, 0.0],  # one-hot: 0
            [1.5, -0.5, 0.0, 0.0],  # one negative of 4 visible
            [1.0, -7.0, 0.0, 0.0],  # one visible key (the -7 is masked): no entropy
        ]
    )[None, None]
    visible = jnp.array([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]], bool)
    neg, ent = kd.weight_stats(w, visible[None, None])
    np.testing.assert_allclose(float(neg), 1 / 13, rtol=1e-6)
    p = np.array([0.75, 0.25])
    want = (1.0 + 0.0 + float(-(p * np.log(p)).sum() / math.log(4))) / 3
    np.testing.assert_allclose(float(ent), want, rtol=1e-6)


def test_attention_tv_on_known_rows():
    """Half the l1 distance per row over the visible keys, averaged over the rows with a
    visible key: rows 0.5, 0, 0 and 1 (a row with a negative weight), the invisible key's
    difference and the row without visible keys left out."""
    w = jnp.array(
        [
            [0.5, 0.5, 0.0, 9.0],  # the 9 is invisible
            [1.0, 0.0, 0.0, 0.0],
            [0.25, 0.25, 0.25, 0.25],
            [1.5, -0.5, 0.0, 0.0],
            [3.0, 3.0, 3.0, 3.0],  # no visible key
        ]
    )[None, None]
    w0 = jnp.array(
        [
            [1.0, 0.0, 0.0, 0.0],
            [1.0, 0.0, 0.0, 0.0],
            [0.25, 0.25, 0.25, 0.25],
            [0.5, 0.5, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
        ]
    )[None, None]
    visible = jnp.array([[1, 1, 1, 0]] + [[1, 1, 1, 1]] * 3 + [[0, 0, 0, 0]], bool)
    got = kd.attention_tv(w, w0, visible[None, None])
    np.testing.assert_allclose(float(got), (0.5 + 0.0 + 0.0 + 1.0) / 4, rtol=1e-6)
    assert float(kd.attention_tv(w, w, visible[None, None])) == 0.0


def _moved(params, freq, tau_shift):
    def move(path, x):
        name = str(getattr(path[-1], "key", ""))
        if name.startswith("omega"):
            return x * freq
        if name == "log_bandwidth":  # every dimension moved by a factor 1.2 up or down
            return x + math.log(1.2) * jnp.where(jnp.arange(x.size) % 2, 1, -1).reshape(x.shape)
        return x + tau_shift if name == "tau" else x

    return jax.tree_util.tree_map_with_path(move, params)


def test_entries_on_known_params():
    """At init the ratios are 1 exactly; frequencies x1.5, tau - 2 log 2 (the scale
    doubled, the tie of linattn_jax.flexformer) and the learned bandwidths x1.2 or /1.2 read
    1.5, 2 and 1.2. Every entry is present and in
    range; hedgehog (positive features) has no negative weights and no frequency entries;
    softmax has no diagnostics."""
    task = toy_task()
    config = tiny_config("flexformer_n", num_features=4, learn_bandwidth=True)
    trainer = Trainer(config, task, devices=jax.devices()[:1])
    diag = kd.for_run(trainer, config)
    start = diag.start
    assert set(start) == {kd.PREFIX + k for k in (*KEYS, "bandwidth_ratio")}
    assert start["kernel/freq_norm_ratio"] == 1.0 and start["kernel/scale_ratio"] == 1.0
    assert start["kernel/bandwidth_ratio"] == 1.0 and start["kernel/freq_move"] == 0.0
    assert 0.0 <= start["kernel/neg_weight_frac"] < 0.5
    assert 0.5 < start["kernel/entropy_ratio"] <= 1.0 + 1e-6
    assert 0.0 <= start["kernel/shift_gap"] < 1e-3  # pairs 0.1 apart: nearly stationary
    state = trainer.init_state()
    moved = state.replace(params=_moved(state.params, 1.5, -2 * math.log(2.0)))
    got = diag(moved)
    np.testing.assert_allclose(got["kernel/freq_norm_ratio"], 1.5, rtol=1e-5)
    np.testing.assert_allclose(got["kernel/freq_move"], 0.5, rtol=1e-5)
    np.testing.assert_allclose(got["kernel/scale_ratio"], 2.0, rtol=1e-5)
    np.testing.assert_allclose(got["kernel/bandwidth_ratio"], 1.2, rtol=1e-5)
    assert got["kernel/entropy_ratio"] < start["kernel/entropy_ratio"]  # sharper kernel
    assert diag.summary() == {"start": start, "end": got}

    hh = tiny_config("hedgehog")
    hh_diag = kd.for_run(Trainer(hh, task, devices=jax.devices()[:1]), hh)
    assert set(hh_diag.start) == {
        f"kernel/{k}" for k in ("neg_weight_frac", "entropy_ratio", "attn_tv")
    }
    assert hh_diag.start["kernel/neg_weight_frac"] == 0.0
    assert kd.for_run(Trainer(tiny_config("softmax"), task), tiny_config("softmax")) is None


def _layers(params):
    """``{layer path: mechanism params}`` of every attention layer, in path order."""
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        names = [str(getattr(p, "key", "")) for p in path]
        if "mechanism" in names:
            i = names.index("mechanism")
            out.setdefault(tuple(names[:i]), {})[names[i + 1]] = np.asarray(x, np.float64)
    return dict(sorted(out.items()))


def test_freq_move_and_attn_tv_by_hand():
    """``freq_move`` = |omega - omega_0|_F / |omega_0|_F over a layer's frequency params
    together, averaged over layers: 0 at init, and on a move that keeps every row norm (a
    rotation, which freq_norm_ratio cannot see: it stays 1) the hand-computed value. Tiny
    shapes: 2 layers, 2 heads, M = 3, d = 8; layer 0 moves omega1 only, layer 1 both. Then
    ``attn_tv`` on the same diagnostics (`_check_attn_tv`)."""
    task = toy_task()
    config = tiny_config("flexformer_n", num_features=3)
    trainer = Trainer(config, task, devices=jax.devices()[:1])
    diag = kd.for_run(trainer, config)
    assert diag.start["kernel/freq_move"] == 0.0
    state = trainer.init_state()
    freq_keys = [k for k in next(iter(_layers(state.params).values())) if k.startswith("omega")]
    assert len(freq_keys) == 2

    def rotate(x, angle):  # rotates every row in its (0, 1) coordinate plane: norms kept
        c, s = math.cos(angle), math.sin(angle)
        x0, x1 = x[..., 0], x[..., 1]
        return x.at[..., 0].set(c * x0 - s * x1).at[..., 1].set(s * x0 + c * x1)

    angles = {0: {freq_keys[0]: 0.3}, 1: {freq_keys[0]: 0.5, freq_keys[1]: -0.2}}
    layer_paths = list(_layers(state.params))
    assert len(layer_paths) == 2

    def move(path, x):
        names = [str(getattr(p, "key", "")) for p in path]
        if "mechanism" not in names:
            return x
        layer = layer_paths.index(tuple(names[: names.index("mechanism")]))
        angle = angles[layer].get(names[-1])
        return x if angle is None else rotate(x, angle)

    moved = jax.tree_util.tree_map_with_path(move, state.params)
    got = diag(state.replace(params=moved))
    want = []
    for p0, p1 in zip(_layers(state.params).values(), _layers(moved).values(), strict=True):
        num = sum(np.sum((p1[k] - p0[k]) ** 2) for k in freq_keys)
        den = sum(np.sum(p0[k] ** 2) for k in freq_keys)
        want.append(math.sqrt(num / den))
    assert min(want) > 0.01
    np.testing.assert_allclose(got["kernel/freq_move"], np.mean(want), rtol=1e-5)
    np.testing.assert_allclose(got["kernel/freq_norm_ratio"], 1.0, rtol=1e-5)
    _check_attn_tv(diag, state, layer_paths)


def _check_attn_tv(diag, state, layer_paths):
    """``attn_tv``: 0 at init, and 0 when only the rest of the model moves (it compares the
    current and the init kernel on the same, current, q and k), both to float32 rounding (the
    two weight computations are separate programs). Layer 1's frequencies set to
    0 make its kernel constant, hence its rows uniform over the visible keys: the entry is
    then (0 + layer 1's mean total variation between uniform rows and its init rows) / 2,
    computed here from the captured q, k."""
    assert diag.start["kernel/attn_tv"] < 1e-6

    def under_mechanism(path):
        return "mechanism" in [str(getattr(p, "key", "")) for p in path]

    others = jax.tree_util.tree_map_with_path(
        lambda path, x: x if under_mechanism(path) else 1.3 * x, state.params
    )
    assert diag(state.replace(params=others))["kernel/attn_tv"] < 1e-6

    def flatten(path, x):
        names = [str(getattr(p, "key", "")) for p in path]
        in_layer1 = tuple(names[: len(layer_paths[1])]) == layer_paths[1]
        return 0.0 * x if in_layer1 and names[-1].startswith("omega") else x

    flat = state.replace(params=jax.tree_util.tree_map_with_path(flatten, state.params))
    got = diag(flat)["kernel/attn_tv"]

    @jax.jit
    def init_weights(params, p0):  # layer 1's init weights [B, Tq, H, Tk] and its key mask
        calls = capture_attention(diag.model, {"params": params}, *diag.probe, deterministic=True)
        call = [c for c in calls if tuple(c.path) == layer_paths[1]][0]
        b, t, h, _ = call.k.shape
        eye = jnp.broadcast_to(jnp.eye(t)[None, :, None, :], (b, t, h, t))
        return diag.mech.attention(call.q, call.k, eye, p0, mask=call.mask), call.mask

    p0 = {k: jnp.asarray(x, jnp.float32) for k, x in _layers(state.params)[layer_paths[1]].items()}
    w0, mask = (np.asarray(x) for x in init_weights(state.params, p0))
    keys = mask.astype(bool)  # [B, T] keys (and queries) that attention sees
    uniform = keys[:, None, None, :] / keys.sum(-1)[:, None, None, None]
    tv = 0.5 * np.sum(np.abs(uniform - w0) * keys[:, None, None, :], -1)  # [B, T, H]
    rows = np.broadcast_to(keys[:, :, None], tv.shape)
    want = np.sum(tv * rows) / np.sum(rows) / 2  # layer 0 unchanged: 0
    assert want > 0.01
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_run_logs_plots_and_summarises(tmp_path):
    """A run writes the entries on its train rows (every log_every steps), kernel.png beside
    curves.png, and start / end values in summary.json and the printed summary."""
    config = tiny_config("flexformer_n", num_features=4)
    config.update(num_train_steps=4, log_every=2, eval_every=4, checkpoint_every=4)
    config.update(progress_bar=False, tensorboard=False, compile_memory_analysis=False)
    config.update(mechanism_lr_mult=10.0, mesh_shape=(1, 1))  # one device (as the others)
    summary = loop.train_and_evaluate(config, tmp_path, data=toy_task())
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train] == [2, 4]
    for r in train:
        assert {kd.PREFIX + k for k in KEYS} <= set(r)
    assert (tmp_path / "kernel.png").stat().st_size > 0 and (tmp_path / "curves.png").exists()
    kernel = json.loads((tmp_path / "summary.json").read_text())["kernel"]
    assert kernel["end"]["kernel/scale_ratio"] == train[-1]["kernel/scale_ratio"]
    assert kernel["start"]["kernel/scale_ratio"] == 1.0 != kernel["end"]["kernel/scale_ratio"]
    assert "kernel (init -> end): attn_tv" in loop.format_summary(summary)
