"""performer (FAVOR+): orthogonal features, unbiasedness and rate, redraws, shared features."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import init, qkv, rel_err

import linattn_jax as la
from linattn_jax import performer


def test_orthogonal_features_are_orthogonal_in_blocks():
    w = performer.orthogonal_features(jax.random.key(0), 2, 20, 8)  # blocks of 8, 8, 4 rows
    assert w.shape == (2, 20, 8)
    for h in range(2):
        for lo, hi in ((0, 8), (8, 16), (16, 20)):
            block = w[h, lo:hi]
            gram = block @ block.T
            np.testing.assert_allclose(gram - jnp.diag(jnp.diag(gram)), 0.0, atol=1e-4)


def test_orthonormal_rows_is_the_sign_fixed_qr_and_the_redraw_calls_no_lapack():
    # the Q^T of the QR of a^T with a positive diagonal in R (the Haar-distributed draw)
    a = jax.random.normal(jax.random.key(0), (3, 8, 8))
    qmat, r = jnp.linalg.qr(jnp.swapaxes(a, -1, -2))
    qmat = qmat * jnp.sign(jnp.diagonal(r, axis1=-2, axis2=-1))[..., None, :]
    rows = performer.orthonormal_rows(a)
    np.testing.assert_allclose(rows, jnp.swapaxes(qmat, -1, -2), atol=2e-6)
    np.testing.assert_allclose(
        rows @ jnp.swapaxes(rows, -1, -2), np.broadcast_to(np.eye(8), (3, 8, 8)), atol=1e-6
    )
    # the per-call redraw is matrix-vector products only: no LAPACK custom call, whose
    # batched QR can deadlock XLA's CPU thread pool when two run at once
    mech = la.get("performer")
    q, k, v = qkv(b=1, tq=4, tk=4, h=2, d=8)
    hlo = (
        jax.jit(lambda q, k, v, rng: mech.attention(q, k, v, init(mech, d=8), rng))
        .lower(q, k, v, jax.random.key(1))
        .as_text()
    )
    assert "custom_call" not in hlo, [ln for ln in hlo.splitlines() if "custom_call" in ln][:3]


def test_performer_kernel_estimate_is_unbiased():
    """E[phi(q) . phi(k)] = exp(q.k / sqrt(d)), checked against the Monte-Carlo error."""
    d, m, n = 8, 16, 4000
    q, k, _ = qkv(seed=3, b=1, tq=3, tk=3, h=1, d=d, scale=0.6)
    target = jnp.exp(jnp.sum(q * k, axis=-1) / jnp.sqrt(d))[0, :, 0]  # pairs (q_i, k_i)

    def estimate(rng):
        w = performer.orthogonal_features(rng, 1, m, d)
        fq, _ = performer.feature_map(q, w, stabilize=False)
        fk, _ = performer.feature_map(k, w, stabilize=False)
        return jnp.sum(fq * fk, axis=-1)[0, :, 0]

    draws = jax.vmap(estimate)(jax.random.split(jax.random.key(0), n))  # [n, 3]
    mean, se = draws.mean(0), draws.std(0) / np.sqrt(n)
    z = np.abs(mean - target) / se
    print("performer kernel estimate: target", target, "mean", mean, "z", z)
    assert np.all(z < 4.0)
    assert np.all(se < 0.05 * target)  # the test has power: SE is small vs the target


def test_performer_error_falls_with_num_features():
    """Output error vs softmax falls ~ M^(-1/2): each 4x more features roughly halves it."""
    q, k, v = qkv(seed=5, b=2, tq=32, tk=32, h=2, d=16, scale=0.5)
    exact = la.get("softmax").attention(q, k, v, {})
    errs = []
    for m in (16, 64, 256, 1024):
        mech = la.get("performer").bind(num_features=m)
        e = [
            rel_err(mech.attention(q, k, v, init(mech, d=16), jax.random.key(s)), exact)
            for s in range(6)
        ]
        errs.append(np.mean(e))
    ratios = np.array(errs[:-1]) / np.array(errs[1:])
    print("performer error vs M=16,64,256,1024:", errs, "ratios", ratios)
    # Ideal ratio 2 (the MC rate); orthogonal features and 6 seeds put it within [1.4, 3].
    assert np.all(ratios > 1.4) and np.all(ratios < 3.0)


def test_performer_redraws_when_asked_unless_deterministic():
    mech = la.get("performer").bind(num_features=16, redraw="call")
    q, k, v = qkv()
    params = init(mech)
    a = mech.attention(q, k, v, params, jax.random.key(1))
    b = mech.attention(q, k, v, params, jax.random.key(2))
    assert not np.allclose(a, b)
    w = params["features"]
    d1 = mech.attention(q, k, v, params, jax.random.key(1), deterministic=True)
    fq, _ = performer.feature_map(q, w)
    fk, nk = performer.feature_map(k, w)
    ref = la.core.quadratic_reference(fq, fk * jnp.exp(nk)[..., None], v)
    np.testing.assert_allclose(d1, ref, rtol=1e-5, atol=1e-6)


def test_performer_shared_features_equal_per_head_copies():
    """``[1, M, d]`` features (the default) are the per-head layout with W tiled over the
    heads, forward and gradients; ``shared_features=False`` draws one W per head."""
    mech = la.get("performer").bind(num_features=8)
    q, k, v = qkv()
    shared = init(mech)
    assert shared["features"].shape == (1, 8, q.shape[-1])
    per_head = init(mech.bind(shared_features=False))
    assert per_head["features"].shape == (q.shape[2], 8, q.shape[-1])
    assert not np.allclose(per_head["features"][0], per_head["features"][1])
    tiled = {"features": jnp.repeat(shared["features"], q.shape[2], axis=0)}

    def loss(params, q):
        return jnp.sum(jnp.sin(mech.attention(q, k, v, params, causal=True, deterministic=True)))

    for causal in (False, True):
        a = mech.attention(q, k, v, shared, causal=causal, deterministic=True)
        b = mech.attention(q, k, v, tiled, causal=causal, deterministic=True)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        jax.grad(loss, argnums=1)(shared, q),
        jax.grad(loss, argnums=1)(tiled, q),
        rtol=1e-5,
        atol=1e-6,
    )
    # A stochastic call redraws the same layout.
    drawn = performer.FEATURE_MAP.draw_fn(shared, jax.random.key(3))
    assert drawn["features"].shape == shared["features"].shape
    with pytest.raises(ValueError, match=r"expected \[H=2, M, d=8\] or \[1, M, d=8\]"):
        mech.attention(q, k, v, {"features": jnp.ones((3, 8, 8))}, deterministic=True)
