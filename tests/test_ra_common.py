"""What ra and lara share (`linattn_jax.ra_common`): the deterministic mode and rng,
padding and masks, jit / vmap / grad / checkpoint, bfloat16, bad configs and inputs.

Statistical tests use fixed seeds and bounds from the Monte-Carlo standard error; inputs,
jitted calls and tolerances are in `_randomized` (its docstring: speed on CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _randomized import (
    FWD_TOL,
    LARA,
    RA,
    D,
    H,
    _assert_trees_close,
    _call,
    _close,
    _finite,
    _key,
    _lengths_mask,
    _out_and_grads,
    _qkv,
    _rms,
)

import linattn_jax as la


def test_registered():
    assert la.get("ra") is RA and la.get("lara") is LARA
    assert RA.supports_causal and RA.stochastic
    assert not LARA.supports_causal and LARA.stochastic
    assert RA.defaults == {"num_samples": 1}
    assert LARA.defaults["num_landmarks"] == 64 and LARA.defaults["mis"] == "opt"
    assert LARA.init(_key(0), num_heads=H, head_dim=D) == {}
    learned = LARA.init(_key(0), num_heads=H, head_dim=D, proposal="learned")
    assert learned["proj_q_w"].shape == (H, D, D) and learned["ln_k_bias"].shape == (H, D)
    np.testing.assert_array_equal(learned["proj_k_w"][1], np.eye(D))


# ----------------------------------------------------------------------------- RA vs reference


# ----------------------------------------------------------------------------- RA statistics


# ----------------------------------------------------------------------------- LARA vs reference


# ----------------------------------------------------------------------------- LARA statistics


# ----------------------------------------------------------------------------- determinism, rng


@pytest.mark.parametrize("mech", [RA, LARA], ids=["ra", "lara"])
def test_deterministic_mode_and_rng(mech):
    q, k, v = _qkv(3)
    cfg = {"num_landmarks": 4} if mech is LARA else {}
    a = _call(mech.attention, q, k, v, deterministic=True, **cfg)
    e1, e2 = (mech.attention(q, k, v, {}, None, deterministic=True, **cfg) for _ in range(2))
    np.testing.assert_array_equal(np.asarray(e1), np.asarray(e2))  # repeatable
    _close(a, e1, 2e-6)  # jit == eager
    with pytest.raises(ValueError, match="rng"):
        mech.attention(q, k, v, {}, **cfg)
    # Stochastic: the same key gives the same draw, another key another draw.
    s1 = _call(mech.attention, q, k, v, rng=jax.random.key(0), **cfg)
    s1b = _call(mech.attention, q, k, v, rng=jax.random.key(0), **cfg)
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(s1b))
    assert _rms(s1, _call(mech.attention, q, k, v, rng=jax.random.key(1), **cfg)) > 1e-3
    assert _rms(s1, a) > 1e-3


# ----------------------------------------------------------------------------- masks


@pytest.mark.parametrize(
    "mech,cfg",
    [
        (RA, {"num_samples": 2, "causal": True}),
        (LARA, {"num_landmarks": 16, "num_samples": 2}),  # 10 tokens < C: L changes on padding
        (LARA, {"num_landmarks": 4, "deterministic": True, "proposal": "learned"}),
    ],
    ids=["ra-causal", "lara-T<C", "lara-det-learned"],
)
def test_padding_changes_nothing(mech, cfg):
    """A padded batch (garbage in the padding) gives the unpadded run on real positions."""
    rng = None if cfg.get("deterministic") else _key(4)
    q, k, v = _qkv(5, b=2, tq=10, tk=10)
    params = {}
    if cfg.get("proposal") == "learned":
        params = LARA.init(_key(0), num_heads=H, head_dim=D, proposal="learned")
    base = _call(mech.attention, q, k, v, params, rng, **cfg)
    qp, kp, vp = (jnp.concatenate([x, 50.0 * jnp.ones_like(x[:, :4])], axis=1) for x in (q, k, v))
    out = _call(mech.attention, qp, kp, vp, params, rng, mask=_lengths_mask([10, 10], 14), **cfg)
    _close(out[:, :10], base, 1e-5)


@pytest.mark.parametrize("mech", [RA, LARA], ids=["ra", "lara"])
def test_masked_keys_anywhere_change_nothing(mech):
    """Cross attention: masked garbage keys interleaved with the real ones change nothing."""
    cfg = {"num_landmarks": 3} if mech is LARA else {}
    q, k, v = _qkv(6, b=2, tq=5, tk=8)
    rng = _key(2)
    base = _call(mech.attention, q, k, v, rng=rng, **cfg)
    keep = jnp.array([True, False, True, True, False, True, True, False, False, True, True, True])
    assert int(keep.sum()) == k.shape[1]
    pos = np.cumsum(np.asarray(keep)) - 1  # the real key feeding each slot
    kp, vp = (jnp.where(keep[None, :, None, None], x[:, pos], 30.0) for x in (k, v))
    mask = jnp.broadcast_to(keep, (2, 12))
    _close(_call(mech.attention, q, kp, vp, rng=rng, mask=mask, **cfg), base, 1e-5)


@pytest.mark.parametrize("mech", [RA, LARA], ids=["ra", "lara"])
def test_fully_masked_rows_are_zero(mech):
    cfg = {"num_landmarks": 4} if mech is LARA else {"num_samples": 2}
    q, k, v = _qkv(7)
    mask = _lengths_mask([12, 0], 12)
    out, grads = _out_and_grads(mech.attention, q, k, v, rng=_key(0), mask=mask, **cfg)
    assert _finite(out) and _finite(grads)
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
    assert float(jnp.max(jnp.abs(out[0]))) > 0


# ----------------------------------------------------------------------------- transforms, dtypes


@pytest.mark.parametrize(
    "mech,cfg",
    [
        (RA, {"num_samples": 3, "causal": True}),
        (LARA, {"num_landmarks": 4, "num_samples": 2, "proposal": "learned"}),
    ],
    ids=["ra", "lara"],
)
def test_jit_vmap_grad_checkpoint(mech, cfg):
    params = {}
    if cfg.get("proposal") == "learned":
        params = LARA.init(_key(0), num_heads=H, head_dim=D, proposal="learned")
    q, k, v = _qkv(8)
    mask = _lengths_mask([12, 8], 12)
    rng = _key(9)

    def fn(q, k, v, p, r, mask=None):
        return mech.attention(q, k, v, p, r, mask=mask, **cfg)

    jitted = _call(fn, q, k, v, params, rng, mask)
    _close(jitted, fn(q, k, v, params, rng, mask), 2e-5)  # jit == eager
    # vmap over an extra leading axis == separate calls.
    qs, ks, vs = (jnp.stack([x, x[::-1]]) for x in (q, k, v))
    masks = jnp.stack([mask, mask[::-1]])
    batched = jax.jit(jax.vmap(lambda a, b, c, m: fn(a, b, c, params, rng, m)))(qs, ks, vs, masks)
    _close(batched[0], jitted, 2e-5)
    _close(batched[1], _call(fn, qs[1], ks[1], vs[1], params, rng, masks[1]), 2e-5)
    # grad w.r.t. q, k, v and every param: finite and nonzero; checkpoint gives the same.
    _, grads = _out_and_grads(fn, q, k, v, params, rng, mask)
    assert _finite(grads)
    for g in jax.tree_util.tree_leaves(grads):
        assert float(jnp.max(jnp.abs(g))) > 0
    _, grads_ckpt = _out_and_grads(jax.checkpoint(fn), q, k, v, params, rng, mask)
    _assert_trees_close(grads, grads_ckpt, 1e-5)


@pytest.mark.parametrize("mech", [RA, LARA], ids=["ra", "lara"])
def test_bf16_and_large_norms(mech):
    cfg = {"num_landmarks": 4} if mech is LARA else {}
    rng = _key(0)
    q, k, v = _qkv(9, dtype=jnp.bfloat16)
    out, grads = _out_and_grads(mech.attention, q, k, v, rng=rng, **cfg)
    assert _finite(grads)
    assert jax.eval_shape(lambda: mech.attention(q, k, v, {}, rng, **cfg)).dtype == jnp.bfloat16
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    _close(out, _call(mech.attention, *f32, rng=rng, **cfg), FWD_TOL[jnp.bfloat16])
    # Tokens with norm 1e2: finite outputs and gradients, stochastic and deterministic.
    qb, kb, vb = _qkv(9)
    qb, kb = (100.0 * x / jnp.linalg.norm(x, axis=-1, keepdims=True) for x in (qb, kb))
    for det in (False, True):
        out, grads = _out_and_grads(
            mech.attention, qb, kb, vb, rng=None if det else rng, deterministic=det, **cfg
        )
        assert _finite(out) and _finite(grads)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "mech,cfg,match",
    [
        (RA, {"num_samples": 0}, "num_samples"),
        (LARA, {"num_samples": 0}, "num_samples"),
        (LARA, {"num_landmarks": 0}, "num_landmarks"),
        (LARA, {"mis": "x"}, "mis"),
        (LARA, {"proposal": "x"}, "proposal"),
        (LARA, {"alpha_coeff": -1.0}, "alpha_coeff"),
        (LARA, {"antithetic": 1}, "antithetic"),
        (LARA, {"grid": (4, 4)}, "grid"),  # 16 cells > T = 12
        (LARA, {"grid": (2,)}, "grid"),
        (LARA, {"proposal": "learned"}, "proj_q_w"),  # params missing
        (LARA, {"proposal": "adaptive-1d"}, "proj_q_w"),
        (LARA, {"noise_scale": 0.0}, "noise_scale"),
        (LARA, {"noise_scale": "x"}, "noise_scale"),
        (LARA, {"mixed": 1}, "mixed"),
    ],
)
def test_bad_config_raises(mech, cfg, match):
    q, k, v = _qkv(0)
    with pytest.raises(ValueError, match=match):
        mech.attention(q, k, v, {}, _key(0), **cfg)
    with pytest.raises(ValueError, match=match):  # also at trace time under jit
        jax.jit(lambda q: mech.attention(q, k, v, {}, _key(0), **cfg))(q)


def test_bad_inputs_raise():
    q, k, v = _qkv(0)
    with pytest.raises(ValueError, match="q must have rank 4"):
        RA.attention(q[0], k, v, {}, _key(0))
    with pytest.raises(ValueError, match="causal=True needs Tq == Tk"):
        RA.attention(q[:, :5], k, v, {}, _key(0), causal=True)
    with pytest.raises(ValueError, match="mask"):
        LARA.attention(q, k, v, {}, _key(0), mask=jnp.ones((2, 5), bool))
    with pytest.raises(ValueError, match="proposal"):
        LARA.init(_key(0), num_heads=H, head_dim=D, proposal="x")
