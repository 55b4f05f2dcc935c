"""Positive spectral features (linattn_jax/flexformer_positive.py, ``features="positive"`` of
flexformer_s and flexformer_n): FAVOR+'s ``exp(Omega y - |y|^2 / 2)`` with the learned
frequencies, flexformer_n's pair summed as its trigonometric map sums it.

Most tests share one input shape (`_inputs`) and the jitted functions of `_jit`, so each
(mechanism, causal) pair compiles once across the file. Masked keys are tested for both maps
in test_flexformer.py."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import linattn_jax as la
from linattn_jax import core
from linattn_jax import flexformer as ff
from linattn_jax import flexformer_positive as fp
from linattn_jax import nn as la_nn
from linattn_jax.core.linear import NONCAUSAL_BLOCK

NAMES = ("flexformer_s", "flexformer_n")
FMAP = {"flexformer_s": ff.feature_map_s, "flexformer_n": ff.feature_map_n}
# Fast path vs quadratic reference, keyed by dtype: (forward, gradients), relative to
# max(1, max |reference|) (as tests/test_flexformer.py).
TOL = {jnp.float32: (2e-5, 1e-4), jnp.bfloat16: (2e-2, None)}
B, T, H, D, DV, M = 2, 11, 2, 8, 4, 16  # T = 11 with chunks of 4: a ragged last chunk
_STATIC = ("causal", "chunk_size")


def _inputs(seed, t=T, scale=0.5, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = scale * jax.random.normal(kq, (B, t, H, D))
    k = scale * jax.random.normal(kk, (B, t, H, D))
    v = jax.random.normal(kv, (B, t, H, DV))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def _mask(t=T):
    m = jax.random.bernoulli(jax.random.key(99), 0.7, (B, t))
    return m.at[:, 0].set(True)  # every causal query sees at least one key


@functools.cache
def _params(name, seed):
    """Params off the init point: flexformer_s's temperature moved; flexformer_n's pair
    separated (omega2 moved by 0.3 N(0, I)) and tau moved."""
    key = jax.random.key(seed)
    p = la.get(name).init(key, num_heads=H, head_dim=D, num_features=M)
    k1, k2 = jax.random.split(jax.random.fold_in(key, 1))
    if name == "flexformer_s":
        return {**p, "log_scale": 0.2 * jax.random.normal(k2, (H,))}
    omega2 = p["omega2_tilde"] + 0.3 / math.sqrt(D) * jax.random.normal(k1, (H, M, D))
    return {**p, "omega2_tilde": omega2, "tau": p["tau"] + 0.2 * jax.random.normal(k2, (H,))}


@functools.cache
def _jit(name, reference=False, **config):
    """The positive mechanism's attention (or reference), jitted once per config."""
    mech = la.get(name).bind(features="positive", **config)
    return jax.jit(mech.reference if reference else mech.attention, static_argnames=_STATIC)


def _close(a, b, tol, what):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = max(1.0, float(np.max(np.abs(b))))
    err = float(np.max(np.abs(a - b)))
    assert err <= tol * scale, f"{what}: max abs diff {err:.3g} > {tol} * {scale:.3g}"


# --------------------------------------------------------------------------- the estimator


def _z_scores(estimates, target):
    e = np.asarray(estimates)
    assert np.all(e > 0)  # every estimate of the positive map is positive
    return (e.mean(0) - target) / (e.std(0, ddof=1) / math.sqrt(e.shape[0]))


@pytest.mark.parametrize("name", NAMES)
def test_positive_kernel_unbiased_at_init(name):
    """Over 2000 independent inits (raw map) the mean estimate is within 4 Monte-Carlo
    standard errors of its expectation: ``exp(q.k / sqrt d)`` for flexformer_s and for
    flexformer_n's tied pair (FAVOR+), `flexformer_positive.init_expectation` for jittered
    pairs (0.1, the default, and 0.5, where it is over 10% above the softmax kernel, which
    the same test then rejects), and frequencies scaled by 1.2 are rejected."""
    n = 2000
    q, k, _ = _inputs(0, t=4, scale=0.6)
    q, k = q[:1, :, :1], k[:1, :, :1]
    softmax = np.exp(np.sum(np.asarray(q * k), -1) / math.sqrt(D))[0, :, 0]

    def expectation(jitter):
        return np.diagonal(np.asarray(fp.init_expectation(q, k, jitter))[0, 0])

    def estimates(key, factor, **init):
        p = la.get(name).init(key, num_heads=1, head_dim=D, num_features=M, **init)
        p = {key_: x * factor if key_.startswith("omega") else x for key_, x in p.items()}
        return jnp.diagonal(ff.kernel(q, k, p, qk_radius=None, features="positive")[0, 0])

    keys = jax.random.split(jax.random.key(7), n)
    # (what, init options, [(frequency factor, target, unbiased)])
    inits = [("init", {}, [(1.0, softmax, True), (1.2, softmax, False)])]
    if name == "flexformer_n":
        e1, e5 = expectation(0.1), expectation(0.5)
        assert np.all(e5 > 1.1 * softmax)
        inits = [
            ("tied", {"pair_init": "tied"}, inits[0][2]),
            ("jitter 0.1", {}, [(1.0, e1, True)]),
            ("jitter 0.5", {"pair_jitter": 0.5}, [(1.0, e5, True), (1.0, softmax, False)]),
        ]
    for what, init, cases in inits:
        draws = jax.jit(jax.vmap(functools.partial(estimates, **init), in_axes=(0, None)))
        for factor, target, unbiased in cases:
            z = _z_scores(draws(keys, factor), target)
            print(f"{name} {what} x{factor}: z {np.round(z, 2)}")
            assert np.all(np.abs(z) < 4) if unbiased else np.all(np.abs(z) > 4), (what, z)


def test_tied_pair_equals_flexformer_s():
    """At the tied init (omega1 = omega2) flexformer_n's positive map is flexformer_s's:
    the same kernel and the same attention, causal and not."""
    q, k, v = _inputs(3)
    mask = _mask()
    ps = ff.init_s(jax.random.key(4), num_heads=H, head_dim=D, num_features=M)
    pn = ff.init_n(jax.random.key(4), num_heads=H, head_dim=D, num_features=M, pair_init="tied")
    for causal in (False, True):
        out_s = _jit("flexformer_s")(q, k, v, ps, mask=mask, causal=causal, chunk_size=4)
        out_n = _jit("flexformer_n")(q, k, v, pn, mask=mask, causal=causal, chunk_size=4)
        _close(out_n, out_s, 1e-5, f"attention, causal={causal}")
    kern = jax.jit(functools.partial(ff.kernel, features="positive"))
    np.testing.assert_allclose(kern(q, k, pn), kern(q, k, ps), rtol=1e-5)


# --------------------------------------------------------------------------- fast path == reference


@functools.cache
def _grads(name, causal):
    """One compiled call: outputs and gradients (q, k, v, params) of the fast path and the
    reference; the weights and outputs at 6x sharper frequencies; den_floor=0's output."""
    lin, ref = _jit(name), _jit(name, reference=True)
    no_floor = _jit(name, den_floor=0.0)
    fm = la.get(name).bind(features="positive").feature_map

    def run(q, k, v, p, mask, wts):
        def loss(fn, *args):
            out = fn(*args, mask=mask, causal=causal, chunk_size=4)
            return jnp.sum(out * wts), out

        vg = jax.grad(loss, argnums=(1, 2, 3, 4), has_aux=True)
        sharp = {key: 6.0 * x if key.startswith("omega") else x for key, x in p.items()}
        phi_k = FMAP[name](k, sharp, is_query=False, mask=mask, features="positive")
        w = core.normalized_weights(fm.query(q, sharp), phi_k, mask=mask, causal=causal)
        outs = [
            fn(q, k, v, sharp, mask=mask, causal=causal, chunk_size=4) for fn in (lin, no_floor)
        ]
        return vg(lin, q, k, v, p), vg(ref, q, k, v, p), w, outs

    return jax.jit(run)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("causal", [False, True])
def test_positive_matches_reference_and_stays_positive(name, causal):
    """Fast path (chunked causal with a ragged last chunk, or non-causal) == the quadratic
    reference of the same features, masked: outputs and the gradients of q, k, v and every
    param (each nonzero: tau too). With frequencies 6x the init scale (the sharp kernels that
    make trigonometric sums cancel) the normalised weights are all >= 0, the visible ones sum
    to 1 per row and give the output; no floor applies (the feature map reports den_floor 0,
    so ``den_floor`` changes nothing)."""
    q, k, v = _inputs(1)
    mask = _mask()
    p = _params(name, 2)
    wts = jax.random.normal(jax.random.key(6), v.shape)
    (g_fast, fast), (g_ref, ref), w, (out_sharp, out_no_floor) = _grads(name, causal)(
        q, k, v, p, mask, wts
    )
    fwd_tol, grad_tol = TOL[jnp.float32]
    _close(fast, ref, fwd_tol, "forward")
    for what, gf, gr in zip("qkv", g_fast[:3], g_ref[:3], strict=True):
        _close(gf, gr, grad_tol, f"grad {what}")
    assert set(g_fast[3]) == set(p)
    for key in p:
        assert float(jnp.max(jnp.abs(g_ref[3][key]))) > 1e-4, f"grad {key} ~ 0"
        _close(g_fast[3][key], g_ref[3][key], grad_tol, f"grad {key}")
    mech = la.get(name)
    assert mech.bind(features="positive").feature_map.den_floor() == 0.0
    assert mech.bind(features="trig").feature_map.den_floor() > 0
    assert float(jnp.min(w)) >= 0.0
    visible = jnp.broadcast_to(mask[:, None, None, :], w.shape)
    if causal:
        visible = visible & jnp.tril(jnp.ones((T, T), bool))[None, None]
    np.testing.assert_allclose(jnp.sum(jnp.where(visible, w, 0.0), -1), 1.0, rtol=1e-5)
    _close(out_sharp, jnp.einsum("bhij,bjhd->bihd", w, v), 1e-4, "sharp: weights times v")
    _close(out_no_floor, out_sharp, 1e-5, "den_floor=0")


@pytest.mark.parametrize("name", NAMES)
def test_positive_bfloat16_matches_reference(name):
    """bfloat16 inputs: output dtype bfloat16, within the bfloat16 tolerance of the
    reference, causal and non-causal (Tq != Tk for the latter)."""
    q, k, v = _inputs(8, dtype=jnp.bfloat16)
    p = _params(name, 9)
    mask = _mask()

    @jax.jit
    def run(q, k, v, p):
        lin, ref = _jit(name), _jit(name, reference=True)
        return [
            (fn(q[:, :7], k, v, p, mask=mask), fn(q, k, v, p, mask=mask, causal=True))
            for fn in (lin, ref)
        ]

    (lin_nc, lin_c), (ref_nc, ref_c) = run(q, k, v, p)
    assert lin_nc.dtype == lin_c.dtype == jnp.bfloat16 and lin_nc.shape == (B, 7, H, DV)
    _close(lin_nc, ref_nc, TOL[jnp.bfloat16][0], "non-causal")
    _close(lin_c, ref_c, TOL[jnp.bfloat16][0], "causal")


@pytest.mark.parametrize("name", NAMES)
def test_positive_matches_explicit_kernel_attention(name):
    """Independent oracle for the stabilisers (the per-token max for queries, the keys' log
    scale over the visible keys, its running max when causal) and for flexformer_n's raw-map
    norm term (tau moved): the attention is ``sum_j K_ij v_j / sum_j K_ij`` with K the
    unstabilised `kernel`, masked keys (and j > i when causal) dropped. Key norms grow
    0.2..6 along the sequence so the maxima move; tau changes the weights."""
    q, k, v = _inputs(24)
    k = k * jnp.linspace(0.2, 6.0, T)[None, :, None, None]
    p = _params(name, 25)
    mask = _mask()
    raw = _jit(name, qk_radius=None)

    @jax.jit
    def run(q, k, v, p):
        kern = ff.kernel(q, k, p, qk_radius=None, features="positive") * mask[:, None, None, :]
        outs = [raw(q, k, v, p, mask=mask, causal=c, chunk_size=4) for c in (False, True)]
        return kern, outs

    kern, outs = run(q, k, v, p)
    for causal, out in zip((False, True), outs):
        a = kern * jnp.tril(jnp.ones((T, T)))[None, None] if causal else kern
        want = jnp.einsum("bhij,bjhd->bihd", a, v) / jnp.sum(a, -1).transpose(0, 2, 1)[..., None]
        _close(out, want, 1e-4, f"attention vs explicit kernel (causal={causal})")
    if name == "flexformer_n":
        moved = {**p, "tau": p["tau"] + 0.5}
        assert float(jnp.max(jnp.abs(run(q, k, v, moved)[1][0] - outs[0]))) > 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_positive_feature_map_and_temperature(name):
    """`feature_map_s` / `feature_map_n` give the row-normalised `kernel` (raw map, masked
    keys dropped); the temperature acts as for the trigonometric map: flexformer_s's
    ``log_scale + g`` and flexformer_n's ``tau - 2 g`` (the tie) equal ``qk_radius`` scaled
    by ``e^g``."""
    q, k, v = _inputs(3)
    mask = _mask()
    p = _params(name, 4)
    g = 0.3
    key, step = ("log_scale", g) if name == "flexformer_s" else ("tau", -2.0 * g)
    moved = {**p, key: p[key] + step}

    @jax.jit
    def run(q, k, v, p, moved):
        fmap = functools.partial(FMAP[name], qk_radius=None, features="positive")
        w = core.normalized_weights(
            fmap(q, p, is_query=True), fmap(k, p, is_query=False, mask=mask), mask=mask
        )
        a = ff.kernel(q, k, p, qk_radius=None, features="positive") * mask[:, None, None, :]
        scaled = _jit(name, qk_radius=math.exp(g))(q, k, v, p, mask=mask)
        return w, a / jnp.sum(a, -1, keepdims=True), _jit(name)(q, k, v, moved, mask=mask), scaled

    w, want, out_moved, out_scaled = run(q, k, v, p, moved)
    _close(w, want, 1e-5, "weights vs normalised kernel")
    _close(out_moved, out_scaled, 1e-5, "temperature e^g == qk_radius e^g")


@pytest.mark.parametrize("name", NAMES)
def test_positive_blocks_equal_the_whole_sequence_features(name):
    """The token-wise passes of the positive map: non-causal block by block (3 blocks of 4,
    Tq != Tk, key log-scales differing across blocks) and causal inside the scan equal the
    core on the whole sequence's features."""
    q, k, v = _inputs(5, scale=1.5)
    mask = _mask()
    p = _params(name, 6)
    fm = la.get(name).bind(features="positive").feature_map
    whole = dataclasses.replace(fm, token_wise=False)

    @jax.jit
    def run(q, k, v, p):
        kw = dict(mask=mask, deterministic=True)
        return [
            (
                core.attend_features(f, q[:, :9], k, v, p, block_size=4, **kw),
                core.attend_features(f, q, k, v, p, causal=True, chunk_size=4, **kw),
            )
            for f in (fm, whole)
        ]

    (blocks, scan), (nc_whole, c_whole) = run(q, k, v, p)
    _close(blocks, nc_whole, 1e-5, "non-causal blocks")
    _close(scan, c_whole, 1e-5, "causal scan")


def test_positive_long_noncausal_block_pass():
    """Past two blocks of `NONCAUSAL_BLOCK` tokens the non-causal pass computes the
    features block by block (`core.noncausal_fused`): equal to the quadratic reference."""
    t = 2 * NONCAUSAL_BLOCK + 76
    q, k, v = _inputs(8, t=t)
    q, k, v = q[:1, :, :1], k[:1, :, :1], v[:1, :, :1]
    p = ff.init_s(jax.random.key(9), num_heads=1, head_dim=D, num_features=M)
    mask = jnp.arange(t)[None] < t - 40
    out = _jit("flexformer_s")(q, k, v, p, mask=mask)
    _close(out, _jit("flexformer_s", reference=True)(q, k, v, p, mask=mask), 2e-5, "blocks")


def test_positive_bad_config():
    q, k, v = _inputs(6)
    for name in NAMES:
        p = _params(name, 7)
        with pytest.raises(ValueError, match="features"):
            la.get(name).attention(q, k, v, p, features="fourier")
        with pytest.raises(ValueError, match="features"):
            la.get(name).feature_map.query(q, p, features="fourier")


# --------------------------------------------------------------------------- fuzz


@functools.cache
def _fuzz_fn(causal, radius):
    lin = _jit("flexformer_n", qk_radius=radius)

    def loss(q, k, v, p, mask):
        out = lin(q, k, v, p, mask=mask, causal=causal, chunk_size=4)
        return jnp.sum(out**2), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=6)
@given(
    st.sampled_from((1e-3, 1e-1, 1.0, 10.0, 100.0)),
    st.booleans(),
    st.sampled_from((ff.QK_RADIUS, None)),
    st.lists(st.integers(0, T), min_size=B, max_size=B),
    st.integers(0, 2**16),
)
def test_positive_fuzz(norm, causal, radius, n_valid, seed):
    """flexformer_n's positive map over token norms 1e-3..1e2, scattered masks (rows with no
    visible key among them), causal or not, the default or the raw map (one input shape: the
    examples share four compiled functions): finite outputs and gradients, zeros for a query
    without visible keys, and every key of a row identical gives the mean of v over the
    visible keys (no floor: the weights are a convex combination)."""
    kq, kk, kv, km = jax.random.split(jax.random.key(seed), 4)
    q, k = (jax.random.normal(key, (B, T, H, D)) for key in (kq, kk))
    q, k = (norm * x / jnp.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    k = k.at[1].set(jnp.broadcast_to(k[1, :1], k[1].shape))  # row 1: every key identical
    v = jax.random.normal(kv, (B, T, H, DV))
    valid = jnp.arange(T)[None] < jnp.array(n_valid)[:, None]
    mask = jax.random.permutation(km, valid, axis=1, independent=True)
    (_, out), grads = _fuzz_fn(causal, radius)(q, k, v, _params("flexformer_n", 2), mask)
    out = np.asarray(out)
    assert np.all(np.isfinite(out))
    for g in jax.tree.leaves(grads):
        assert np.all(np.isfinite(np.asarray(g)))
    vis = np.broadcast_to(np.asarray(mask)[:, None, :], (B, T, T))
    if causal:
        vis = vis & np.tril(np.ones((T, T), bool))[None]
    np.testing.assert_array_equal(out[~vis.any(-1)], 0.0)
    w = vis[1] / np.maximum(vis[1].sum(-1, keepdims=True), 1)
    np.testing.assert_allclose(out[1], np.einsum("ij,jhd->ihd", w, v[1]), atol=1e-4)


# --------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("name", NAMES)
def test_positive_decode_equals_parallel_causal(name):
    """`la.nn` decoding (``init_cache``, then one token per ``decode=True`` call: the feature
    map's recurrent state, `core.recurrent_step`) reproduces the parallel causal layer."""
    x = jax.random.normal(jax.random.key(0), (B, 5, 16))
    config = {"num_features": M, "features": "positive"}
    layer = la_nn.MultiHeadAttention(
        2, 16, attention=name, attention_config=config, rngs=nnx.Rngs(0)
    )
    want = nnx.jit(lambda m, x: m(x, causal=True))(layer, x)
    layer.init_cache(x.shape)
    step = nnx.jit(lambda m, x: m(x, decode=True))
    got = jnp.concatenate([step(layer, x[:, i : i + 1]) for i in range(5)], 1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
