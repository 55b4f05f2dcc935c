"""rfa: the Gaussian kernel on the sphere, the gated causal form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import init, qkv

import linattn_jax as la
from linattn_jax import rfa


def test_rfa_kernel_is_gaussian_on_the_sphere():
    """E[phi(q).phi(k)] = exp(-|sigma (q^ - k^)|^2 / 2) for unit q^, k^."""
    d, m, n = 8, 16, 3000
    q, k, _ = qkv(seed=2, b=1, tq=3, tk=3, h=1, d=d)
    params = init(la.get("rfa").bind(num_features=m), h=1, d=d)
    params["sigma"] = jnp.full((1, d), 0.8)
    qu = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
    ku = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    target = jnp.exp(-0.5 * jnp.sum((0.8 * (qu - ku)) ** 2, -1))[0, :, 0]

    def estimate(r):
        w = jax.random.normal(r, (1, m, d))
        return jnp.sum(rfa.feature_map(q, params, w) * rfa.feature_map(k, params, w), -1)[0, :, 0]

    draws = jax.vmap(estimate)(jax.random.split(jax.random.key(1), n))
    z = np.abs(draws.mean(0) - target) / (draws.std(0) / np.sqrt(n))
    assert np.all(z < 4.0), z


@pytest.mark.parametrize("t,chunk", [(10, 4), (8, 8), (1, 2)])
def test_rfa_gated_causal_matches_reference(t, chunk):
    mech = la.get("rfa").bind(num_features=8, gate=True, chunk_size=chunk)
    q, k, v = qkv(tq=t, tk=t)
    params = init(mech)
    params["gate_w"] = jax.random.normal(jax.random.key(4), params["gate_w"].shape)

    def value_and_grad(fn):  # one compiled program per form (not one per eager op)
        out = lambda p: fn(q, k, v, p, deterministic=True, causal=True)  # noqa: E731
        return jax.jit(lambda p: (out(p), jax.grad(lambda p: out(p).sum())(p)))(params)

    (oa, ga), (orf, gr) = value_and_grad(mech.attention), value_and_grad(mech.reference)
    np.testing.assert_allclose(oa, orf, atol=1e-5)
    for key in ("gate_w", "gate_b", "sigma"):
        np.testing.assert_allclose(ga[key], gr[key], rtol=1e-3, atol=1e-5)
    assert jnp.any(ga["gate_w"] != 0)
    with pytest.raises(ValueError, match="causal"):
        mech.attention(q, k, v, params, deterministic=True)
