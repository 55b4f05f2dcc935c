"""The shared linear-attention core: chunked causal == masked quadratic reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linattn_jax import core


def _features(seed, b=2, t=13, h=2, m=6, dv=5, signed=False):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    pq = jax.random.normal(k1, (b, t, h, m))
    pk = jax.random.normal(k2, (b, t, h, m))
    if signed:  # some negative entries, denominators kept away from 0 (well-conditioned)
        pq, pk = 1.0 + 0.5 * pq, 1.0 + 0.5 * pk
    else:
        pq, pk = jnp.exp(pq), jnp.exp(pk)
    return pq, pk, jax.random.normal(k3, (b, t, h, dv))


@pytest.mark.parametrize("t,chunk", [(13, 4), (16, 4), (13, 64), (1, 8), (7, 1), (20, 7)])
@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_causal_chunked_matches_quadratic(t, chunk, signed, with_mask):
    pq, pk, v = _features(t, t=t, signed=signed)
    mask = None
    if with_mask:
        mask = jax.random.bernoulli(jax.random.key(3), 0.7, (2, t)).at[:, 0].set(True)

    def f(fn, pq, pk, v):
        kw = dict(mask=mask, causal=True)
        if fn is core.linear_attention:
            kw["chunk_size"] = chunk
        return fn(pq, pk, v, **kw)

    fast = f(core.linear_attention, pq, pk, v)
    ref = f(core.quadratic_reference, pq, pk, v)
    np.testing.assert_allclose(fast, ref, rtol=1e-4, atol=1e-5)

    def loss(fn):
        return lambda *a: jnp.sum(jnp.sin(f(fn, *a)))

    g_fast = jax.grad(loss(core.linear_attention), argnums=(0, 1, 2))(pq, pk, v)
    g_ref = jax.grad(loss(core.quadratic_reference), argnums=(0, 1, 2))(pq, pk, v)
    for a, b in zip(g_fast, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("t,chunk", [(13, 4), (9, 9), (1, 3)])
def test_gated_causal_matches_quadratic(t, chunk):
    pq, pk, v = _features(1, t=t, signed=True)
    log_decay = jax.nn.log_sigmoid(jax.random.normal(jax.random.key(9), (2, t, 2)) + 1.0)

    def run(fn, pq, pk, v, ld, **kw):
        return fn(pq, pk, v, causal=True, log_decay=ld, **kw)

    fast = run(core.linear_attention, pq, pk, v, log_decay, chunk_size=chunk)
    ref = run(core.quadratic_reference, pq, pk, v, log_decay)
    np.testing.assert_allclose(fast, ref, rtol=1e-4, atol=1e-5)
    gf = jax.grad(lambda *a: run(core.linear_attention, *a, chunk_size=chunk).sum(), (0, 3))(
        pq, pk, v, log_decay
    )
    gr = jax.grad(lambda *a: run(core.quadratic_reference, *a).sum(), (0, 3))(pq, pk, v, log_decay)
    for a, b in zip(gf, gr):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_gated_recurrence_matches_explicit_loop():
    """The decay form equals the literal recurrence S_t = g_t S_{t-1} + phi(k_t) v_t^T."""
    pq, pk, v = _features(2, b=1, t=6, h=1, m=3, dv=2)
    g = jax.nn.sigmoid(jax.random.normal(jax.random.key(4), (1, 6, 1)))
    s, z, outs = np.zeros((3, 2)), np.zeros(3), []
    for t in range(6):
        s = g[0, t, 0] * s + np.outer(pk[0, t, 0], v[0, t, 0])
        z = g[0, t, 0] * z + pk[0, t, 0]
        outs.append(pq[0, t, 0] @ s / (pq[0, t, 0] @ z))
    fast = core.linear_attention(pq, pk, v, causal=True, chunk_size=4, log_decay=jnp.log(g))
    np.testing.assert_allclose(fast[0, :, 0], np.stack(outs), rtol=1e-5, atol=1e-6)


def test_noncausal_matches_quadratic_and_masks():
    pq, pk, v = _features(5, t=11)
    mask = jnp.arange(11)[None, :] < jnp.array([[11], [4]])
    out = core.linear_attention(pq, pk, v, mask=mask)
    np.testing.assert_allclose(out, core.quadratic_reference(pq, pk, v, mask=mask), rtol=1e-5)
    # Row 1 equals the run on its 4 unpadded keys.
    short = core.linear_attention(pq[1:], pk[1:, :4], v[1:, :4])
    np.testing.assert_allclose(out[1:], short, rtol=1e-5, atol=1e-6)


def test_fully_masked_rows_are_zero_not_nan():
    pq, pk, v = _features(6, t=5, signed=True)
    mask = jnp.zeros((2, 5), bool)
    for causal in (False, True):
        out = core.linear_attention(pq, pk, v, mask=mask, causal=causal, chunk_size=2)
        assert jnp.all(out == 0.0)
        g = jax.grad(
            lambda x, c=causal: core.linear_attention(x, pk, v, mask=mask, causal=c).sum()
        )(pq)
        assert jnp.all(jnp.isfinite(g))


def test_guard_denominator():
    den = jnp.array([0.0, 1e-9, -1e-9, 0.5, -0.5])
    out = core.guard_denominator(den, eps=1e-6)
    np.testing.assert_allclose(out, [2e-6, 1e-9 + 2e-6, -1e-9 - 2e-6, 0.5, -0.5], rtol=1e-6)
    assert jnp.all(jnp.abs(out) > 1e-6)


def test_bf16_features_accumulate_in_f32():
    pq, pk, v = _features(7, t=33)
    out16 = core.linear_attention(
        pq.astype(jnp.bfloat16), pk.astype(jnp.bfloat16), v.astype(jnp.bfloat16), causal=True
    )
    assert out16.dtype == jnp.float32
    ref = core.quadratic_reference(
        *(x.astype(jnp.bfloat16).astype(jnp.float32) for x in (pq, pk, v)), causal=True
    )
    np.testing.assert_allclose(out16, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_key_log_scale_equals_explicit_scaling(causal):
    pq, pk, v = _features(8, t=13, signed=True)
    ns = 3.0 * jax.random.normal(jax.random.key(2), (2, 13, 2))
    mask = jax.random.bernoulli(jax.random.key(5), 0.7, (2, 13))
    explicit = core.quadratic_reference(
        pq, pk * jnp.exp(ns)[..., None], v, mask=mask, causal=causal
    )
    for fn in (core.linear_attention, core.quadratic_reference):
        kw = {"chunk_size": 4} if fn is core.linear_attention else {}
        out = fn(pq, pk, v, mask=mask, causal=causal, key_log_scale=ns, **kw)
        np.testing.assert_allclose(out, explicit, rtol=1e-4, atol=1e-5)
    g = jax.grad(
        lambda n: core.linear_attention(
            pq, pk, v, causal=causal, key_log_scale=n, chunk_size=4
        ).sum()
    )(ns)
    g_ref = jax.grad(
        lambda n: core.quadratic_reference(pq, pk * jnp.exp(n)[..., None], v, causal=causal).sum()
    )(ns)
    np.testing.assert_allclose(g, g_ref, rtol=1e-3, atol=1e-4)


def test_key_log_scale_is_stable_and_causal():
    """Huge log-scales stay finite, and a huge future key cannot reach past queries
    through the stabiliser (the running max only sees keys j <= i)."""
    pq, pk, v = _features(9, t=12, signed=True)
    ns = jnp.zeros((2, 12, 2))
    out = core.linear_attention(pq, pk, v, causal=True, key_log_scale=ns, chunk_size=4)
    ns_future = ns.at[:, 8:].set(500.0)  # exp(500) overflows float32 if not stabilised
    out2 = core.linear_attention(pq, pk, v, causal=True, key_log_scale=ns_future, chunk_size=4)
    assert jnp.all(jnp.isfinite(out2))
    np.testing.assert_allclose(out2[:, :8], out[:, :8], rtol=1e-5, atol=1e-6)
