"""ra (randomized attention, Zheng et al. 2022): the reference, the blocked and flax forms,
the backward, several samples, unbiasedness at the Monte-Carlo rate."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _randomized import (
    FWD_TOL,
    GRAD_TOL,
    RA,
    H,
    _assert_trees_close,
    _call,
    _close,
    _key,
    _lengths_mask,
    _normal,
    _out_and_grads,
    _qkv,
    _rms,
    _softmax,
)

from linattn_jax import ra


@pytest.mark.parametrize(
    "causal,masked,num_samples,deterministic",
    [
        (False, False, 1, False),
        (False, True, 3, False),
        (True, True, 2, False),
        (True, True, 1, True),
    ],
)
@pytest.mark.parametrize("blocked", [False, True], ids=["whole", "blocked"])
def test_ra_matches_reference(causal, masked, num_samples, deterministic, blocked, monkeypatch):
    """Fast path == naive reference (same draws), forward and gradients; causal included;
    `blocked`: the 12 queries taken 4 at a time (``ra.QUERY_BLOCK``, as over long sequences)."""
    if blocked:
        monkeypatch.setattr(ra, "QUERY_BLOCK", 4)
    q, k, v = _qkv(0)
    mask = _lengths_mask([12, 7], 12) if masked else None
    rng = None if deterministic else _key(3)
    if blocked and not deterministic:  # threefry: a position's draw is the same in any block
        rng = jax.random.key(3)
    kw = dict(mask=mask, causal=causal, deterministic=deterministic, num_samples=num_samples)
    out, g = _out_and_grads(RA.attention, q, k, v, rng=rng, **kw)
    out_ref, g_ref = _out_and_grads(RA.reference, q, k, v, rng=rng, **kw)
    _close(out, out_ref, FWD_TOL[jnp.float32])
    _assert_trees_close(g, g_ref, GRAD_TOL)
    for x in g[:3]:
        assert float(jnp.max(jnp.abs(x))) > 0
    if causal:  # query 0 sees only key 0: whatever the draw, its output is v_0
        _close(out[:, 0], v[:, 0], 1e-6)


@pytest.mark.parametrize("num_samples", [1, 3])
def test_ra_backward_recomputes_only_f(num_samples, monkeypatch):
    """A recomputed query block keeps its draws (`ra.DRAW`: the chosen keys and omega), so
    the backward pass does not redo the proposal's inverse CDF: the gradient's program has
    the forward's one cumsum (two without the saved draws)."""
    monkeypatch.setattr(ra, "QUERY_BLOCK", 4)
    q, k, v = _qkv(0)

    def loss(q, k, v):
        return jnp.sum(RA.attention(q, k, v, {}, jax.random.key(3), num_samples=num_samples))

    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
    assert jaxpr.count("cumsum[axis") == 1


def test_ra_flax_form_in_query_blocks(monkeypatch):
    """RA under flax's conventions with a per-query mask, a full bias and per-entry dropout
    gives the same values and gradients when its 13 queries are taken 4 at a time (the
    last block padded)."""
    q, k, v = _qkv(4, tq=13, tk=13)
    mask = jnp.tril(jnp.ones((13, 13), bool))[None, None]
    bias = _normal(5, 2, H, 13, 13)
    drop = dict(dropout_rate=0.2, dropout_rng=_key(6), broadcast_dropout=False)

    def run():
        def loss(q, k, v, b):
            # threefry: a position's draw is the same in a vmap over 4 or 13 positions
            out = ra.ra_flax_attention(q, k, v, jax.random.key(7), mask=mask, bias=b, **drop)
            return jnp.sum(jnp.sin(out)), out

        return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, bias)

    g_whole, out_whole = run()
    monkeypatch.setattr(ra, "QUERY_BLOCK", 4)
    g_blocked, out_blocked = run()
    _close(out_blocked, out_whole, FWD_TOL[jnp.float32])
    _assert_trees_close(g_blocked, g_whole, GRAD_TOL)


def test_ra_num_samples_averages_independent_draws():
    q, k, v = _qkv(2)
    rng = jax.random.key(5)  # threefry: split keys draw the same under vmap and scan
    many = _call(RA.attention, q, k, v, rng=rng, num_samples=4)
    singles = jax.jit(jax.vmap(lambda r: RA.attention(q, k, v, {}, r)))(jax.random.split(rng, 4))
    _close(many, jnp.mean(singles, axis=0), 2e-6)
    assert _rms(singles[0], singles[1]) > 1e-2  # the draws really differ


_RA_SIZES = (16, 256, 4096)


def _ra_draws(causal, masked):
    """16 independent problems (batch), 16 + 256 + 4096 single-draw outputs each (float64)."""
    q, k, v = _qkv(10, b=16, tq=8, tk=8, h=1, d=4, dv=2)
    mask = _lengths_mask(np.arange(16) % 4 + 5, 8) if masked else None
    keys = jax.random.split(_key(11), sum(_RA_SIZES))
    draw = jax.jit(jax.vmap(lambda r: ra.ra_attention(q, k, v, {}, r, mask=mask, causal=causal)))
    # float64 on the host: a float32 mean over 4096 draws drifts by ~1e-4.
    target = np.asarray(_softmax(q, k, v, mask, causal), np.float64)
    return np.asarray(draw(keys), np.float64), target


def _z_checks(draws, target):
    """Mean of the draws vs target: every |z| < 4 and mean z^2 ~ 1 (chi-square)."""
    sd = draws.std(axis=0, ddof=1)
    live = sd > 1e-6  # e.g. causal query 0: the output is v_0 for every draw
    err = draws.mean(axis=0) - target
    z = err[live] / (sd[live] / np.sqrt(len(draws)))
    print(
        f"RA S={len(draws)}: max|z| = {np.abs(z).max():.2f}, mean z^2 = {np.mean(z**2):.3f}, "
        f"n = {z.size}"
    )
    assert np.abs(z).max() < 4.0
    # Unbiased: mean z^2 ~ 1 +- sqrt(2 / n) (~0.09 for n = 256); allow 4.5 standard errors.
    assert abs(np.mean(z**2) - 1.0) < 4.5 * np.sqrt(2.0 / z.size)
    np.testing.assert_allclose(err[~live], 0.0, atol=1e-6)  # zero-spread entries are exact


def test_ra_unbiased_and_monte_carlo_rate():
    """RA is unbiased, and the error of the S-draw mean falls like 1/sqrt(S).

    Rate: standardised errors (error / per-entry std) of the means of disjoint sets
    of S = 16, 256, 4096 draws are ~N(0, 1/S), so their RMS over n = 256 entries has
    relative standard error 1/sqrt(2n) and the ratio per 16x step is 4 with relative
    standard error 1/sqrt(n) = 6.25%; the band [3.0, 5.0] is 4 of those.
    """
    draws, target = _ra_draws(causal=False, masked=False)
    _z_checks(draws[-4096:], target)
    sd = draws[-4096:].std(axis=0, ddof=1)
    rms, off = {}, 0
    for s in _RA_SIZES:
        err = (draws[off : off + s].mean(axis=0) - target) / sd
        rms[s] = float(np.sqrt(np.mean(err**2)))
        off += s
    ratios = [rms[16] / rms[256], rms[256] / rms[4096]]
    print(f"RA standardised RMS error {rms}; ratios per 16x {ratios}")
    for r in ratios:
        assert 3.0 < r < 5.0


def test_ra_unbiased_causal_masked():
    draws, target = _ra_draws(causal=True, masked=True)
    _z_checks(draws[-4096:], target)
