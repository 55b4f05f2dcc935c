"""lara (linear randomized attention): the reference, the MIS weights, consistency, the
official noise, against performer, causal refused, the presets' proposals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _randomized import (
    DV,
    FWD_TOL,
    GRAD_TOL,
    LARA,
    D,
    H,
    _assert_trees_close,
    _call,
    _close,
    _finite,
    _key,
    _lengths_mask,
    _normal,
    _out_and_grads,
    _qkv,
    _rms,
    _softmax,
)

import linattn_jax as la


@pytest.mark.parametrize(
    "cfg",
    [
        dict(num_landmarks=4),
        dict(num_landmarks=5, num_samples=3, mis="bh", grid=(3, 4), masked=True),
        # T < C (and the masked row has 7 < 12 tokens): invalid landmark slots.
        dict(num_landmarks=20, num_samples=2, antithetic=True, masked=True, proposal="learned"),
        dict(num_landmarks=4, deterministic=True, masked=True),
        dict(num_landmarks=4, tq=9, tk=13, alpha_coeff=0.5),  # cross attention; Tk % C != 0
        dict(num_landmarks=3, num_samples=2, noise_scale=1.0, proposal="adaptive-1d"),
        dict(num_landmarks=4, grid=(3, 3), proposal="pool", mixed=True, masked=True, tq=13),
        # gamma = 8: about a tenth of the opt weights fall below the floor (the clamp binds).
        dict(num_landmarks=4, num_samples=2, alpha_coeff=8.0, masked=True),
    ],
    ids=["opt", "bh-S3-grid", "antithetic-learned-T<C", "det", "cross", "adaptive", "pool-mixed"]
    + ["clamped"],
)
def test_lara_matches_reference(cfg):
    """Fast path == straightforward reference (same draws), forward and gradients."""
    cfg = dict(cfg)
    masked = cfg.pop("masked", False)
    deterministic = cfg.pop("deterministic", False)
    tq = cfg.pop("tq", 12)
    tk = cfg.pop("tk", tq)
    q, k, v = _qkv(0, tq=tq, tk=tk)
    mask = _lengths_mask([tk, 7], tk) if masked else None
    params = LARA.init(_key(0), num_heads=H, head_dim=D, proposal=cfg.get("proposal", "mean"))
    # Move the learned proposal off its init so every param matters.
    params = jax.tree_util.tree_map(lambda p: p + 0.3 * _normal(7, *p.shape), params)
    rng = None if deterministic else _key(3)
    kw = dict(mask=mask, deterministic=deterministic, **cfg)
    out, g = _out_and_grads(LARA.attention, q, k, v, params, rng, **kw)
    out_ref, g_ref = _out_and_grads(LARA.reference, q, k, v, params, rng, **kw)
    assert out.shape == (2, tq, H, DV)
    _close(out, out_ref, FWD_TOL[jnp.float32])
    _assert_trees_close(g, g_ref, GRAD_TOL)
    assert _finite(g)


def test_lara_opt_with_zero_coeff_is_bh():
    q, k, v = _qkv(4)
    mask = _lengths_mask([12, 9], 12)
    kw = dict(rng=_key(1), mask=mask, num_landmarks=4, num_samples=2)
    bh = _call(LARA.attention, q, k, v, mis="bh", **kw)
    _close(_call(LARA.attention, q, k, v, mis="opt", alpha_coeff=0.0, **kw), bh, 1e-6)
    # ...and the query-dependent correction does change the estimate when gamma > 0.
    assert _rms(_call(LARA.attention, q, k, v, mis="opt", alpha_coeff=1.0, **kw), bh) > 1e-6


def test_lara_consistent():
    """With the paper's noise (noise_scale=1) the error vs softmax falls monotonically with
    num_samples (mean over 6 problems)."""
    q, k, v = _qkv(20, b=6, tq=16, tk=16, h=2, d=4, dv=3)
    target = _softmax(q, k, v)
    errs = {}
    for s in (1, 16, 256, 4096):
        out = _call(
            LARA.attention, q, k, v, rng=_key(s), num_landmarks=4, num_samples=s, noise_scale=1.0
        )
        errs[s] = float(jnp.mean(jnp.sqrt(jnp.mean(jnp.square(out - target), axis=(1, 2, 3)))))
    print(f"LARA mean RMS error vs softmax by num_samples: {errs}")
    vals = list(errs.values())
    assert all(a > b for a, b in zip(vals, vals[1:], strict=False))
    assert errs[4096] < 0.25 * errs[1]


def test_lara_default_noise_one_sample_error():
    """At T = 1024, d = 64, q and k scaled by 0.5: with the default noise
    (the official d^(-1/4)) one sample's error vs softmax is within 1.5x that of the mean of
    v; with the paper's unit noise it is not (so the bound can fail). Mean relative error
    over 4 keys (single-key spread of the ratio ~0.05 on these inputs)."""
    q, k, v = _qkv(30, b=1, tq=1024, tk=1024, h=1, d=64, dv=64)
    q, k = 0.5 * q, 0.5 * k
    target = _softmax(q, k, v)

    def rel(out):
        return float(jnp.linalg.norm(out - target) / jnp.linalg.norm(target))

    mean_v = rel(jnp.broadcast_to(jnp.mean(v, axis=1, keepdims=True), v.shape))
    errs = {}
    for scale in (None, 1.0):
        errs[scale] = np.mean(
            [rel(_call(LARA.attention, q, k, v, rng=_key(i), noise_scale=scale)) for i in range(4)]
        )
    print(f"relative error: mean of v {mean_v:.3f}, lara 1 sample {errs}")
    assert errs[None] <= 1.5 * mean_v
    assert errs[1.0] > 1.5 * mean_v


def test_lara_noise_scale_default_is_official():
    """``noise_scale=None`` is ``d ** -0.25``; another scale gives other draws."""
    q, k, v = _qkv(31)
    kw = dict(rng=_key(2), num_landmarks=4)
    base = _call(LARA.attention, q, k, v, **kw)
    np.testing.assert_array_equal(_call(LARA.attention, q, k, v, noise_scale=D**-0.25, **kw), base)
    assert _rms(_call(LARA.attention, q, k, v, noise_scale=1.0, **kw), base) > 1e-3


def _clustered(seed, b=32, t=64, h=2, d=16, dv=8, n_clusters=4, noise=0.3):
    """Queries and keys from a few clusters (per problem): structured attention."""
    gen = np.random.default_rng(seed)
    centers = gen.standard_normal((b, n_clusters, d))
    rows = np.arange(b)[:, None, None]
    q = centers[rows, gen.integers(0, n_clusters, (b, t, h))]  # [B, T, H, d]
    k = centers[rows, gen.integers(0, n_clusters, (b, t, h))]
    q = q + noise * gen.standard_normal((b, t, h, d))
    k = k + noise * gen.standard_normal((b, t, h, d))
    v = gen.standard_normal((b, t, h, dv))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))


def test_lara_beats_performer_on_clustered_inputs():
    """LARA (C = 16, one sample) vs performer (M = 16 and 32 redrawn features), 32 problems."""
    q, k, v = _clustered(0)
    target = _softmax(q, k, v)
    perf = la.get("performer")

    def per_problem(out):
        return np.asarray(jnp.sqrt(jnp.mean(jnp.square(out - target), axis=(1, 2, 3))))

    rng = _key(77)
    e_lara = per_problem(_call(LARA.attention, q, k, v, rng=rng, num_landmarks=16))
    e_perf = {}
    for m in (16, 32):
        p = perf.init(_key(5), num_heads=2, head_dim=16, num_features=m)
        e_perf[m] = per_problem(_call(perf.attention, q, k, v, p, rng))
    diff = e_perf[16] - e_lara
    z = diff.mean() / (diff.std(ddof=1) / np.sqrt(len(diff)))
    print(
        f"mean RMS error vs softmax over {len(diff)} problems: lara C=16 {e_lara.mean():.4f}, "
        f"performer M=16 {e_perf[16].mean():.4f}, M=32 {e_perf[32].mean():.4f}; "
        f"paired (perf16 - lara) / SE = {z:.2f}"
    )
    assert z > 3.0  # equal cost: LARA better, by more than 3 paired standard errors
    assert e_lara.mean() < e_perf[32].mean()  # twice performer's budget: still better on average


def test_lara_causal_not_implemented():
    q, k, v = _qkv(0)
    with pytest.raises(NotImplementedError, match="lara"):
        LARA.attention(q, k, v, {}, _key(0), causal=True)


def test_presets_lara_proposals():
    """ViT presets: the official image proposals (pool + mixed, 7 x 7 = 49 landmarks; mini
    16); LRA presets: the library default."""
    from train import configs

    for preset, m in (("mini", 16), ("cifar", 49), ("deit_tiny", 49)):
        c = configs.set_attention(configs.get_config("vit", preset), "lara")
        assert c.attention_config.to_dict() == {
            "proposal": "pool",
            "mixed": True,
            "num_landmarks": m,
        }
    assert (
        configs.set_attention(
            configs.get_config("listops", "mini"), "lara"
        ).attention_config.to_dict()
        == {}
    )
