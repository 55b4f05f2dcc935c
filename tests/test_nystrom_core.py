"""What the Nystrom family shares (`linattn_jax.nystrom_core`), for nystromformer, soft and
laplacian alike: the linear path against the materialised reference, weights, masks,
cross-attention, grid landmarks, jit / vmap / grad / checkpoint, bfloat16, errors.

The float64 numpy oracles (`_nystrom`) are written independently of the library: the full
``T x T`` kernel matrices (Laplace, Gaussian, softmax) and the Nystrom estimate from
explicitly given landmarks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _nystrom import (
    _TOL_LINEAR,
    CASES,
    IDS,
    D,
    H,
    _apply,
    _close,
    _gauss_np,
    _inputs,
    _np,
    _params,
)

import linattn_jax as la
from linattn_jax import laplacian as lap
from linattn_jax import nystromformer as nf
from linattn_jax import soft as sf

# --------------------------------------------------------------------------- numpy oracles


# --------------------------------------------------------------------------- fast path vs reference


@pytest.mark.parametrize("name,cfg", CASES, ids=IDS)
def test_linear_path_matches_materialised_reference(name, cfg):
    """O(T m) path == the T x T materialised C_q A^+ C_k, forward and gradients, with a
    mask and T = 11 not divisible by m = 4. Tolerances are relative to the largest
    entry: the plain "row" ablation can have near-zero denominators (effective weights
    of magnitude ~60 here), which amplify rounding alike in both forms."""
    mech = la.get(name).bind(num_landmarks=4, **cfg)
    q, k, v = _inputs(0, tq=11)
    mask = jnp.arange(11)[None, :] < jnp.array([11, 8])[:, None]
    cot = jax.random.normal(jax.random.key(42), v.shape[:3] + (4,)) * mask[:, :, None, None]
    params = _params(name)

    def run(fn):
        def loss(q, k, v, params):
            out = fn(q, k, v, params, mask=mask)
            return jnp.sum(out * cot), out

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, params)

    (gf, out_f), (gr, out_r) = run(mech.attention), run(mech.reference)
    _close(out_f, out_r, _TOL_LINEAR[cfg.get("normalize")], "output")
    for what, a, b in zip(("q", "k", "v", "params"), gf, gr):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert np.all(np.isfinite(x))
            tol = 10 * _TOL_LINEAR[cfg.get("normalize")]
            _close(x, y, tol * max(1.0, float(np.max(np.abs(y)))), f"grad {what}")
    if name == "laplacian":
        assert float(jnp.max(jnp.abs(gf[3]["log_lam"]))) > 1e-4  # lambda is really learnt


# --------------------------------------------------------------------------- m = T: the full kernel


# --------------------------------------------------------------------------- the kernel option


# --------------------------------------------------------------------------- injectivity


def test_weights_are_the_weights_of_the_output():
    q, k, v = _inputs(6, tq=11, scale=0.8)
    mask = jnp.arange(11)[None, :] < jnp.array([11, 6])[:, None]
    params = _params("laplacian")
    w = lap.laplacian_weights(q, k, params, mask=mask, num_landmarks=4)
    assert float(jnp.max(jnp.abs(jnp.where(mask[:, None, None, :], 0.0, w)))) == 0.0
    out = lap.laplacian_attention(q, k, v, params, mask=mask, num_landmarks=4)
    _close(out, jnp.einsum("bhij,bjhd->bihd", w, v), 1e-5, "weights @ v")


# --------------------------------------------------------------------------- masks


@pytest.mark.parametrize("name,cfg", CASES, ids=IDS)
def test_masked_keys_change_nothing(name, cfg):
    """Padded rows (valid lengths 7 and 3 of T = 10, m = 4: T and 7 not divisible by m,
    and 3 < m) equal the runs on the unpadded sequences on the valid positions; padding
    holds large garbage. A row with every key masked returns zeros."""
    mech = la.get(name).bind(num_landmarks=4, **cfg)
    params = _params(name)
    t, lengths = 10, (7, 3)
    q, k, v = _inputs(7, tq=t)
    fn = jax.jit(mech.attention)
    for row, n in enumerate(lengths):
        mask = jnp.zeros((1, t), bool).at[:, :n].set(True)
        junk = 50.0 * jnp.ones((1, t - n, H, D))
        qp = q[row : row + 1].at[:, n:].set(junk)
        kp = k[row : row + 1].at[:, n:].set(-junk)
        vp = v[row : row + 1].at[:, n:].set(1e3)
        padded = fn(qp, kp, vp, params, mask=mask)
        plain = fn(q[row : row + 1, :n], k[row : row + 1, :n], v[row : row + 1, :n], params)
        _close(padded[:, :n], plain, 2e-5, f"{name} valid length {n}")
    empty = fn(q, k, v, params, mask=jnp.zeros((2, t), bool))
    assert float(jnp.max(jnp.abs(empty))) == 0.0


def test_cross_attention_key_mask():
    """Tq != Tk (key mask only; queries have no mask): padded keys change nothing."""
    q, k, v = _inputs(8, b=1, tq=6, tk=9)
    for name, cfg in (("laplacian", {}), ("soft", {}), ("nystromformer", {})):
        mech = la.get(name).bind(num_landmarks=4, **cfg)
        params = _params(name)
        mask = jnp.arange(9)[None, :] < 5
        attend = jax.jit(mech.attention)  # one program per shape, not one per eager op
        padded = attend(q, k.at[:, 5:].set(30.0), v.at[:, 5:].set(1e3), params, mask=mask)
        plain = attend(q, k[:, :5], v[:, :5], params)
        _close(padded, plain, 2e-5, name)


# --------------------------------------------------------------------------- grid landmarks


def test_grid_landmarks_on_image_with_cls_token():
    """T = 1 + 8 * 8 (a CLS token then an 8 x 8 image), grid=(8, 8), m = 16: the landmarks
    are 2 x 2 average pools (4 x 4 grid) of the image tokens, the CLS token excluded.
    Oracle: soft (tied, symmetric PSD A, so (A + eps I)^-1 is well conditioned)."""
    q, k, v = _inputs(9, b=1, tq=65, scale=0.7)
    img = _np(q)[:, 1:].reshape(1, 4, 2, 4, 2, H, D)
    ql = img.mean((2, 4)).reshape(1, 16, H, D)
    qq = _np(q)
    w = _gauss_np(qq, ql) @ np.linalg.inv(_gauss_np(ql, ql) + 0.01 * np.eye(16))
    w = w @ _gauss_np(ql, qq)
    out = sf.soft_attention(q, k, v, {}, num_landmarks=16, grid=(8, 8), inverse="exact")
    _close(out, _apply(w, _np(v)), 1e-4, "grid soft")
    # The grid runs through the shared core: linear path == reference (two kernels).
    for name, c in (CASES[0], CASES[3]):
        mech = la.get(name).bind(num_landmarks=16, grid=(8, 8), **c)
        p = _params(name, grid=(8, 8)) if name == "laplacian" else {}
        a, r = jax.jit(mech.attention)(q, k, v, p), jax.jit(mech.reference)(q, k, v, p)
        assert a.shape == (1, 65, H, 4)
        _close(a, r, _TOL_LINEAR[c.get("normalize")], f"{name} grid")


# --------------------------------------------------------------------------- transforms, dtypes


@pytest.mark.parametrize("name", ["nystromformer", "soft", "laplacian"])
def test_jit_vmap_grad_checkpoint(name):
    """Row valid lengths 9, 3 (< m = 4: an inert landmark slot) and 0 (all masked)."""
    mech = la.get(name).bind(num_landmarks=4)
    params = _params(name)
    q, k, v = _inputs(10, b=3, tq=9)
    mask = jnp.arange(9)[None, :] < jnp.array([9, 3, 0])[:, None]
    eager = mech.attention(q, k, v, params, mask=mask)
    jitted_call = jax.jit(lambda a, b, c: mech.attention(a, b, c, params, mask=mask))
    _close(jitted_call(q, k, v), eager, 1e-5, "jit vs eager")
    # vmap over an extra leading axis == stacking the per-slice calls
    qs, ks, vs = (jnp.stack([x, 0.5 * x]) for x in (q, k, v))
    # (jitted: an eager vmap dispatches op by op, which costs a minute on CI)
    batched = jax.jit(jax.vmap(lambda a, b, c: mech.attention(a, b, c, params, mask=mask)))(
        qs, ks, vs
    )
    _close(batched[1], jitted_call(qs[1], ks[1], vs[1]), 1e-5, "vmap")
    _close(batched[0], eager, 1e-5, "vmap")
    # vmap over the batch (one example at a time) == the batched call: per-sequence statistics
    per_example = jax.jit(
        jax.vmap(
            lambda a, b, c, m: mech.attention(a[None], b[None], c[None], params, mask=m[None])[0]
        )
    )(q, k, v, mask)
    _close(per_example, eager, 1e-5, "vmap over the batch")

    def loss(q, k, v, params):
        f = jax.checkpoint(lambda *a: mech.attention(*a, mask=mask))
        return jnp.sum(f(q, k, v, params) ** 2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, params)
    for g in jax.tree.leaves(grads):
        assert np.all(np.isfinite(g))
    assert float(jnp.max(jnp.abs(grads[0][:2]))) > 0
    assert float(jnp.max(jnp.abs(grads[2][2]))) == 0.0  # an all-masked row reads no value
    if name == "laplacian":
        assert float(jnp.max(jnp.abs(grads[3]["log_lam"]))) > 0
        assert float(jnp.max(jnp.abs(grads[3]["local"]))) > 0


@pytest.mark.parametrize("name,cfg", CASES, ids=IDS)
def test_bf16_and_large_norms(name, cfg):
    """bf16 inputs: bf16 output, finite, close to the fp32 run on the same (rounded)
    values; inputs of norm up to 1e2: finite outputs and gradients."""
    mech = la.get(name).bind(num_landmarks=4, **cfg)
    params = _params(name)
    attend = jax.jit(mech.attention)  # one program per dtype, not one per eager op
    q, k, v = _inputs(11, tq=9, scale=0.5, dtype=jnp.bfloat16)
    out = attend(q, k, v, params)
    assert out.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(out, np.float32)))
    ref = attend(*(x.astype(jnp.float32) for x in (q, k, v)), params)
    _close(out, ref, 2e-2, "bf16 vs fp32")

    def loss(q, k, v, params):
        return jnp.sum(mech.attention(q, k, v, params) ** 2)

    value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    for scale in (10.0, 100.0 / math.sqrt(D)):  # per-token norms up to ~1e2
        q, k, v = _inputs(12, tq=9, scale=scale)
        val, grads = value_and_grad(q, k, v, params)
        assert np.isfinite(float(val)), f"scale {scale}"
        for g in jax.tree.leaves(grads):
            assert np.all(np.isfinite(g)), f"grad at scale {scale}"


# --------------------------------------------------------------------------- API and errors


def test_errors():
    q, k, v = _inputs(14, tq=8)
    p = _params("laplacian")
    for name in ("nystromformer", "soft", "laplacian"):
        mech = la.get(name)
        pp = _params(name)
        with pytest.raises(NotImplementedError, match=name):
            mech.attention(q, k, v, pp, causal=True)
        for bad in (
            {"num_landmarks": 0},
            {"ns_iters": 0},
            {"inverse": "svd"},
            {"grid": (0, 4)},
            {"grid": [2, 2]},
            {"grid": (4, 4)},  # 16 > T = 8
        ):
            with pytest.raises(ValueError, match=name):
                mech.attention(q, k, v, pp, **bad)
    for name in ("soft", "laplacian"):
        pp = _params(name)
        for bad in ({"normalize": "x"}, {"eps": -1.0}, {"impl": "cuda"}):
            with pytest.raises(ValueError, match=name):
                la.get(name).attention(q, k, v, pp, **bad)
    with pytest.raises(ValueError, match="normalize"):
        sf.soft_attention(q, k, v, {}, normalize="injective")
    with pytest.raises(ValueError, match="tie_qk"):  # SOFT ties k := q, so Tq == Tk
        sf.soft_attention(q, k[:, :5], v[:, :5], {}, tie_qk=True)
    with pytest.raises(ValueError, match="tie_qk"):
        sf.soft_attention(q, k, v, {}, tie_qk="yes")
    with pytest.raises(ValueError, match="lam"):
        lap.laplacian_attention(q, k, v, {}, lam=-1.0)
    with pytest.raises(ValueError, match="log_lam"):
        lap.laplacian_attention(q, k, v, {"local": p["local"]})
    for bad in (2, -1, 3.0, True, None):
        with pytest.raises(ValueError, match="local_window"):
            lap.laplacian_attention(q, k, v, p, local_window=bad)
        with pytest.raises(ValueError, match="local_window"):
            lap.laplacian_init(jax.random.key(0), num_heads=H, head_dim=D, local_window=bad)
    with pytest.raises(
        ValueError, match=r"params\['local'\] has shape \(3, 2\), expected \(5, 2\)"
    ):
        lap.laplacian_attention(q, k, v, p, local_window=5)
    with pytest.raises(ValueError, match="'local'"):  # init without grid, called with one
        lap.laplacian_attention(q, k, v, p, grid=(2, 2))
    for bad in ("x", "Injective", None):
        with pytest.raises(ValueError, match="normalize"):
            lap.laplacian_attention(q, k, v, p, normalize=bad)
    with pytest.raises(ValueError, match="shared_landmarks"):
        lap.laplacian_attention(q, k, v, p, shared_landmarks=1)
    with pytest.raises(ValueError, match="log_lam"):  # lam fixed but params carry log_lam
        lap.laplacian_attention(q, k, v, p, lam=1.0)
    with pytest.raises(ValueError, match=r"k \(2, 8, 1, 8\)"):
        nf.nystromformer_attention(q, k[:, :, :1], v, {})
