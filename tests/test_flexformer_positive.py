"""flexformer_s with positive spectral features (``features="positive"``):
FAVOR+'s ``exp(Omega y - |y|^2 / 2)`` with the learned frequencies ``Omega``."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linattn_jax as la
from linattn_jax import core
from linattn_jax import flexformer as ff
from linattn_jax.core.linear import NONCAUSAL_BLOCK

_STATIC = ("causal", "chunk_size")


def _inputs(key, b=2, t=12, h=2, d=8, dv=4, scale=0.5):
    kq, kk, kv = jax.random.split(key, 3)
    q = scale * jax.random.normal(kq, (b, t, h, d))
    k = scale * jax.random.normal(kk, (b, t, h, d))
    return q, k, jax.random.normal(kv, (b, t, h, dv))


def _mask(b, t):
    m = jax.random.bernoulli(jax.random.key(99), 0.7, (b, t))
    return m.at[:, 0].set(True)


def _params(key, h=2, d=8, m=16):
    p = ff.init_s(key, num_heads=h, head_dim=d, num_features=m)
    return {**p, "log_scale": 0.2 * jax.random.normal(jax.random.fold_in(key, 1), (h,))}


def test_positive_kernel_unbiased_at_init():
    """E[phi+(q) . phi+(k)] = exp(q.k / sqrt d) over independent inits (raw map), within 4 MC
    standard errors; frequencies scaled by 1.2 are rejected by the same test. Every estimate
    is positive."""
    d, m, n = 8, 16, 2000
    q, k, _ = _inputs(jax.random.key(0), b=1, t=4, h=1, d=d, scale=0.6)
    target = np.exp(np.sum(np.asarray(q * k), -1) / math.sqrt(d))[0, :, 0]

    def estimates(key, factor):
        p = ff.init_s(key, num_heads=1, head_dim=d, num_features=m)
        p = {**p, "omega_tilde": factor * p["omega_tilde"]}
        kern = ff.kernel(q, k, p, qk_radius=None, features="positive")
        return jnp.diagonal(kern[0, 0])

    draws = jax.jit(jax.vmap(estimates, in_axes=(0, None)))
    keys = jax.random.split(jax.random.key(7), n)
    for factor, unbiased in ((1.0, True), (1.2, False)):
        e = np.asarray(draws(keys, factor))
        assert np.all(e > 0)
        z = (e.mean(0) - target) / (e.std(0, ddof=1) / math.sqrt(n))
        assert np.all(np.abs(z) < 4) if unbiased else np.all(np.abs(z) > 4), z


@pytest.mark.parametrize("causal", [False, True])
def test_positive_attention_matches_reference_and_stays_positive(causal):
    """Linear == quadratic reference (outputs and gradients of every param), masked; with
    frequencies 6x the init scale (the sharp kernels that make trigonometric sums cancel) the
    normalised weights are all >= 0 and rows sum to 1: no floor applies (the feature map
    reports den_floor 0, so ``den_floor`` changes nothing)."""
    q, k, v = _inputs(jax.random.key(1))
    mask = _mask(2, 12)
    p = _params(jax.random.key(2))
    mech = la.get("flexformer_s").bind(features="positive")
    lin = jax.jit(mech.attention, static_argnames=_STATIC)
    ref = jax.jit(mech.reference, static_argnames=_STATIC)
    out = lin(q, k, v, p, mask=mask, causal=causal, chunk_size=4)
    np.testing.assert_allclose(out, ref(q, k, v, p, mask=mask, causal=causal), atol=2e-5)

    def loss(fn, p):
        return jnp.sum(fn(q, k, v, p, mask=mask, causal=causal) * v)

    g = jax.grad(lambda p: loss(lambda *a, **kw: lin(*a, chunk_size=4, **kw), p))(p)
    g_ref = jax.grad(lambda p: loss(ref, p))(p)
    for key in p:
        assert float(jnp.max(jnp.abs(g[key]))) > 1e-4, key
        np.testing.assert_allclose(g[key], g_ref[key], atol=1e-4, rtol=1e-4)
    sharp = {**p, "omega_tilde": 6.0 * p["omega_tilde"]}
    fm = mech.feature_map
    assert fm.den_floor() == 0.0 and la.get("flexformer_s").feature_map.den_floor() > 0
    # the keys' features with their log scale (the per-token max) applied, stabilised
    phi_k = ff.feature_map_s(k, sharp, is_query=False, mask=mask, features="positive")
    w = core.normalized_weights(fm.query(q, sharp), phi_k, mask=mask, causal=causal)
    assert float(jnp.min(w)) >= 0.0
    visible = jnp.broadcast_to(mask[:, None, None, :], w.shape)
    if causal:
        visible = visible & jnp.tril(jnp.ones((12, 12), bool))[None, None]
    np.testing.assert_allclose(jnp.sum(jnp.where(visible, w, 0.0), -1), 1.0, rtol=1e-5)
    out_sharp = lin(q, k, v, sharp, mask=mask, causal=causal, chunk_size=4)
    np.testing.assert_allclose(out_sharp, jnp.einsum("bhij,bjhd->bihd", w, v), atol=1e-4)
    no_floor = la.get("flexformer_s").bind(features="positive", den_floor=0.0)
    np.testing.assert_allclose(
        no_floor.attention(q, k, v, sharp, mask=mask, causal=causal, chunk_size=4),
        out_sharp,
        atol=1e-5,
    )


def test_positive_feature_map_and_temperature():
    """`feature_map_s` gives the row-normalised `kernel` (raw map, masked keys dropped); the
    temperature acts as for the trigonometric map: ``log_scale + g`` equals ``qk_radius``
    scaled by ``e^g``."""
    q, k, v = _inputs(jax.random.key(3), t=9)
    mask = _mask(2, 9)
    p = _params(jax.random.key(4))
    phi_q = ff.feature_map_s(q, p, is_query=True, qk_radius=None, features="positive")
    phi_k = ff.feature_map_s(k, p, is_query=False, mask=mask, qk_radius=None, features="positive")
    w = core.normalized_weights(phi_q, phi_k, mask=mask)
    a = ff.kernel(q, k, p, qk_radius=None, features="positive") * mask[:, None, None, :]
    np.testing.assert_allclose(w, a / jnp.sum(a, -1, keepdims=True), atol=1e-5)
    mech = la.get("flexformer_s").bind(features="positive")
    g = 0.3
    moved = {**p, "log_scale": p["log_scale"] + g}
    np.testing.assert_allclose(
        mech.attention(q, k, v, moved, mask=mask),
        mech.attention(q, k, v, p, mask=mask, qk_radius=math.exp(g)),
        atol=1e-5,
    )


def test_positive_bad_config():
    q, k, v = _inputs(jax.random.key(6), t=5)
    p = _params(jax.random.key(7))
    with pytest.raises(ValueError, match="features"):
        la.get("flexformer_s").attention(q, k, v, p, features="fourier")
    pn = ff.init_n(jax.random.key(0), num_heads=2, head_dim=8, num_features=8)
    with pytest.raises(ValueError, match="features must be 'trig'"):
        la.get("flexformer_n").attention(q, k, v, pn, features="positive")
    with pytest.raises(ValueError, match="features must be 'trig'"):
        la.get("flexformer_n").feature_map.query(q, pn, features="positive")


def test_positive_long_noncausal_block_pass():
    """Past two blocks of `NONCAUSAL_BLOCK` tokens the non-causal pass computes the
    features block by block (`core.noncausal_fused`): equal to the quadratic reference."""
    t = 2 * NONCAUSAL_BLOCK + 76
    q, k, v = _inputs(jax.random.key(8), b=1, t=t, h=1)
    p = _params(jax.random.key(9), h=1)
    mech = la.get("flexformer_s").bind(features="positive")
    mask = jnp.arange(t)[None] < t - 40
    out = jax.jit(mech.attention)(q, k, v, p, mask=mask)
    np.testing.assert_allclose(out, jax.jit(mech.reference)(q, k, v, p, mask=mask), atol=2e-5)
