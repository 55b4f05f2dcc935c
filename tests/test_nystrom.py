"""Tests for the Nystrom family: nystromformer, soft, laplacian (linattn_jax/nystromformer.py,
soft.py and laplacian.py over nystrom_core.py).

Oracles are written here in float64 numpy, independently of the library: the full
``T x T`` kernel matrices (Laplace, Gaussian, softmax) and the Nystrom estimate from
explicitly given landmarks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linattn_jax as la
from linattn_jax import laplacian as lap
from linattn_jax import nystrom_core
from linattn_jax import nystromformer as nf
from linattn_jax import soft as sf

# (mechanism, config) cases covering every normalisation.
CASES = [
    ("nystromformer", {}),
    ("soft", {"normalize": "none"}),
    ("soft", {"normalize": "row"}),
    ("laplacian", {"normalize": "injective"}),
    ("laplacian", {"normalize": "uncentered"}),
    ("laplacian", {"normalize": "row"}),
    ("laplacian", {"normalize": "none"}),
    ("laplacian", {"shared_landmarks": False, "local_window": 0}),
    ("laplacian", {"kernel": "gaussian", "normalize": "injective"}),  # the kernel ablation
]
IDS = [f"{n}-{c.get('normalize', 'none')}-{len(c)}" for n, c in CASES]
WEIGHTS = {
    "nystromformer": nf.nystromformer_weights,
    "soft": sf.soft_weights,
    "laplacian": lap.laplacian_weights,
}
H, D = 2, 8
# Linear path vs materialised reference (relative to the largest entry), by normalisation:
# the plain "row" ablation divides by estimated row sums that can come close to 0.
_TOL_LINEAR = {None: 1e-5, "none": 1e-5, "injective": 1e-5, "uncentered": 1e-5, "row": 2e-4}


def _inputs(seed, b=2, tq=10, tk=None, h=H, d=D, dv=4, scale=1.0, dtype=jnp.float32):
    tk = tq if tk is None else tk
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = scale * jax.random.normal(kq, (b, tq, h, d))
    k = scale * jax.random.normal(kk, (b, tk, h, d))
    v = jax.random.normal(kv, (b, tk, h, dv))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def _params(name, seed=3, h=H, d=D, **config):
    p = la.get(name).init(jax.random.key(seed), num_heads=h, head_dim=d, **config)
    if "log_lam" in p:  # move lambda off its init, and make it differ per head
        p = {**p, "log_lam": p["log_lam"] + jnp.linspace(-0.3, 0.3, h)}
    return p


def _close(a, b, tol, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(1.0, float(np.max(np.abs(b))))
    err = float(np.max(np.abs(a - b)))
    assert err <= tol * scale, f"{what}: max abs diff {err:.3g} > {tol} * {scale:.3g}"
    return err


# --------------------------------------------------------------------------- numpy oracles


def _np(x):
    return np.asarray(x, np.float64)


def _laplace_np(x, y, lam):
    """x [B,N,H,D], y [B,M,H,D], lam [H] -> [B,H,N,M]."""
    dist = np.abs(x[:, :, None] - y[:, None, :]).sum(-1)  # [B, N, M, H]
    return np.exp(-dist.transpose(0, 3, 1, 2) / lam[None, :, None, None])


def _gauss_lam_np(x, y, lam):
    """laplacian's ``kernel="gaussian"``: ``exp(-|x - y|_2^2 / (sqrt(pi) lam))``, shapes as
    `_laplace_np`."""
    sq = ((x[:, :, None] - y[:, None, :]) ** 2).sum(-1)  # [B, N, M, H]
    return np.exp(-sq.transpose(0, 3, 1, 2) / (math.sqrt(math.pi) * lam[None, :, None, None]))


#: laplacian's kernels (config ``kernel``) in numpy.
_LAP_KERNELS_NP = {"laplace": _laplace_np, "gaussian": _gauss_lam_np}


def _gauss_np(x, y):
    d = x.shape[-1]
    x, y = x * d**-0.25, y * d**-0.25
    sq = ((x[:, :, None] - y[:, None, :]) ** 2).sum(-1).transpose(0, 3, 1, 2)
    return np.exp(-0.5 * sq)


def _softmax_np(x, y, col_valid=None):
    logits = np.einsum("bnhd,bmhd->bhnm", x, y) / math.sqrt(x.shape[-1])
    if col_valid is not None:
        logits = np.where(col_valid[:, None, None, :], logits, -np.inf)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _apply(w, v):
    return np.einsum("bhij,bjhd->bihd", w, v)


def _whiten_np(c, center=True):
    """Column whitening over the query axis (-2) of c [B,H,T,L]: centred, divided by the std
    (without `center`: divided by the root mean square)."""
    if center:
        c = c - c.mean(-2, keepdims=True)
    return c / np.sqrt((c**2).mean(-2, keepdims=True) + nystrom_core.WHITEN_EPS)


def _local_np(w, v):
    """Depthwise convolution along the sequence, one filter w [win, H] per head (zero padded)."""
    r = w.shape[0] // 2
    v = _np(v)
    vp = np.pad(v, ((0, 0), (r, r), (0, 0), (0, 0)))
    t = v.shape[1]
    return sum(_np(w)[o][None, None, :, None] * vp[:, o : o + t] for o in range(w.shape[0]))


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


@pytest.mark.parametrize("kernel", ["laplace", "gaussian"])
def test_laplacian_m_equals_t_is_full_kernel(kernel):
    """Landmarks = tokens, an exact inverse, eps = 0 and no local branch: laplacian is the
    quadratic computation on the full kernel matrix K = kappa(Q, K) (Laplace, or the
    Gaussian ``exp(-|q_i - k_j|_2^2 / (sqrt(pi) lambda))``; with shared landmarks C_q = K
    and A^+ C_k = kappa(K, K)^-1 kappa(K, K) = I), in every normalisation:
    row: K V / K 1;  injective: whiten_columns(K) V;  uncentered: each column of K divided
    by its root mean square;  none: K V. The effective weights of "none" are K's entries,
    and its gradients (q, k, v, lambda) are those of the naive K V."""
    q, k, v = _inputs(1, tq=8)
    params = _params("laplacian", local_window=0)
    kmat = _LAP_KERNELS_NP[kernel](_np(q), _np(k), np.exp(_np(params["log_lam"])))
    cfg = dict(num_landmarks=8, eps=0.0, local_window=0, kernel=kernel)
    w = lap.laplacian_weights(q, k, params, normalize="none", inverse="exact", **cfg)
    _close(w, kmat, 2e-4, f"{kernel} kernel entries")
    want = {
        "row": _apply(kmat / kmat.sum(-1, keepdims=True), _np(v)),
        "injective": _apply(_whiten_np(kmat), _np(v)),
        "uncentered": _apply(_whiten_np(kmat, center=False), _np(v)),
        "none": _apply(kmat, _np(v)),
    }
    errs = {}
    for norm, inverse, iters in (
        ("row", "exact", 20),
        ("injective", "exact", 20),
        ("uncentered", "exact", 20),
        ("none", "exact", 20),
        ("row", "iterative", 60),
        ("injective", "iterative", 60),
    ):
        out = lap.laplacian_attention(
            q, k, v, params, normalize=norm, inverse=inverse, ns_iters=iters, **cfg
        )
        errs[norm, inverse] = _close(out, want[norm], 2e-4, f"{norm} {inverse}")
    print(f"laplacian ({kernel}) m=T max abs err:", errs)

    # Gradients of "none" (out = K V; A^+ C_k = I has none) against the naive kernel in jnp.
    def naive(q, k, v, log_lam):
        diff = q[:, :, None] - k[:, None, :]  # [B, N, M, H, D]
        if kernel == "laplace":
            dist = jnp.sum(jnp.abs(diff), -1)
        else:
            dist = jnp.sum(diff**2, -1) / math.sqrt(math.pi)
        kern = jnp.exp(-dist / jnp.exp(log_lam)[None, None, None])  # [B, N, M, H]
        return jnp.einsum("bijh,bjhd->bihd", kern, v)

    def lib(q, k, v, log_lam):
        p = {"log_lam": log_lam}
        return lap.laplacian_attention(q, k, v, p, normalize="none", inverse="exact", **cfg)

    cot = jax.random.normal(jax.random.key(5), v.shape)
    grads = [
        jax.grad(lambda *a, f=f: jnp.sum(f(*a) * cot), argnums=(0, 1, 2, 3))(
            q, k, v, params["log_lam"]
        )
        for f in (lib, naive)
    ]
    for what, a, b in zip(("q", "k", "v", "log_lam"), *grads):
        _close(a, b, 1e-3 * max(1.0, float(jnp.max(jnp.abs(b)))), f"{kernel} grad {what}")


def test_soft_m_equals_t_is_full_gaussian_kernel():
    """soft with landmarks = tokens: C_q A^+ C_k = K (tied: K = Gaussian(q^, q^)), so
    out = K V ("none") and K V / K 1 ("row"); k is unused when tied."""
    q, k, v = _inputs(2, tq=8)
    kmat = _gauss_np(_np(q), _np(q))
    errs = {}
    for norm, want in (
        ("none", _apply(kmat, _np(v))),
        ("row", _apply(kmat / kmat.sum(-1, keepdims=True), _np(v))),
    ):
        for inverse, iters in (("exact", 20), ("iterative", 60)):
            out = sf.soft_attention(
                q, k * 7.0, v, {}, num_landmarks=8, eps=0.0, normalize=norm, inverse=inverse,
                ns_iters=iters,
            )  # fmt: skip
            errs[norm, inverse] = _close(out, want, 2e-4, f"{norm} {inverse}")
    # Untied: the key side is k, and with m = T the estimate is the full K(q^, k^).
    kmat = _gauss_np(_np(q), _np(k))
    out = sf.soft_attention(q, k, v, {}, num_landmarks=8, eps=0.0, inverse="exact", tie_qk=False)
    errs["untied"] = _close(out, _apply(kmat, _np(v)), 2e-4, "untied")
    print("soft m=T max abs err:", errs)


def test_nystromformer_m_equals_t_is_softmax_attention():
    """Landmarks = tokens: C_q = A = C_k = softmax(Q K^T / sqrt d) =: S, and S S^+ S = S.
    Exact pinv and 20 iterations are tight; the paper's 6 iterations are measured."""
    q, k, v = _inputs(3, tq=8, scale=0.7)
    want = _apply(_softmax_np(_np(q), _np(k)), _np(v))
    exact = nf.nystromformer_attention(q, k, v, {}, num_landmarks=8, inverse="exact")
    err_exact = _close(exact, want, 1e-4, "exact pinv")
    err_20 = _close(
        nf.nystromformer_attention(q, k, v, {}, num_landmarks=8, ns_iters=20), want, 1e-4, "20 it"
    )
    err_6 = float(
        np.max(np.abs(_np(nf.nystromformer_attention(q, k, v, {}, num_landmarks=8)) - want))
    )
    print(f"nystromformer m=T max abs err: exact {err_exact:.2e}, 20 it {err_20:.2e}, ", end="")
    print(f"6 it {err_6:.2e}")
    assert err_6 < 0.1  # measured ~1e-2: the 6-step iteration has not fully converged
    assert err_20 < err_6


def _segment_landmarks(q, k):
    """Segment means of q and k (T = 10, m = 4: segments of sizes 3, 2, 3, 2), numpy."""
    seg = np.array([0, 0, 0, 1, 1, 2, 2, 2, 3, 3])  # floor(r * 4 / 10)
    onehot = (seg[:, None] == np.arange(4)).astype(np.float64)
    avg = onehot / onehot.sum(0)
    return tuple(np.einsum("tl,bthd->blhd", avg, _np(x)) for x in (q, k))


@pytest.mark.parametrize("kernel", ["laplace", "gaussian"])
def test_segment_landmarks_match_numpy_nystrom(kernel):
    """General m: laplacian equals the textbook Nystrom formula from explicitly computed
    segment-mean landmarks (T = 10, m = 4), with either kernel."""
    q, k, v = _inputs(4, b=1, tq=10)
    params = _params("laplacian")
    ql, kl = _segment_landmarks(q, k)
    lam = np.exp(_np(params["log_lam"]))
    kap = lambda x, y: _LAP_KERNELS_NP[kernel](x, y, lam)  # noqa: E731
    cq = kap(_np(q), kl)
    # Shared landmarks (default): A = kappa(K~, K~), C_k = kappa(K~, K); with the local branch.
    a, ck = kap(kl, kl), kap(kl, _np(k))
    w = cq @ np.linalg.inv(a + 0.01 * np.eye(4)) @ ck
    cfg = dict(num_landmarks=4, kernel=kernel)
    out = lap.laplacian_attention(q, k, v, params, normalize="row", **cfg)
    want = _apply(w / w.sum(-1, keepdims=True), _np(v)) + _local_np(params["local"], v)
    _close(out, want, 2e-4, f"{kernel} row, m=4")
    wi = _whiten_np(cq) @ np.linalg.inv(a + 0.01 * np.eye(4)) @ ck
    out = lap.laplacian_attention(q, k, v, params, **cfg)
    _close(out, _apply(wi, v) + _local_np(params["local"], v), 2e-4, f"{kernel} injective")
    # Separate landmarks: A = kappa(Q~, K~), C_k = kappa(Q~, K).
    a, ck = kap(ql, kl), kap(ql, _np(k))
    wi = _whiten_np(cq) @ np.linalg.inv(a) @ ck
    out = lap.laplacian_attention(
        q, k, v, params, eps=0.0, inverse="exact", shared_landmarks=False, local_window=0, **cfg
    )
    _close(out, _apply(wi, v), 2e-4, f"{kernel} injective separate landmarks")


def test_segment_landmarks_match_numpy_nystromformer():
    """nystromformer from the same segment-mean landmarks: softmax kernels, output
    C_q A^+ C_k V."""
    q, k, v = _inputs(4, b=1, tq=10)
    ql, kl = _segment_landmarks(q, k)
    s = lambda x, y: _softmax_np(x, y)  # noqa: E731
    w = s(_np(q), kl) @ np.linalg.pinv(s(ql, kl)) @ s(ql, _np(k))
    out = nf.nystromformer_attention(q, k, v, {}, num_landmarks=4, inverse="exact")
    _close(out, _apply(w, _np(v)), 2e-4, "nystromformer, m=4")


# --------------------------------------------------------------------------- the kernel option


def test_gaussian_bandwidth_matches_laplace_at_init():
    """``kernel="gaussian"`` at the init lambda = d / 2 on unit-Gaussian q, k (d = 16 and 64,
    the real models' head dims): its median entry is within 25% of the Laplace kernel's
    (c = sqrt(pi) equalises the mean exponents, 4 / sqrt(pi); the medians differ by the
    skew of |q - k|_2^2), both near 0.1. Entries: the effective weights with landmarks =
    tokens and normalize="none" (K itself, `test_laplacian_m_equals_t_is_full_kernel`)."""
    for d in (16, 64):
        q, k, _ = _inputs(30 + d, b=1, tq=48, h=1, d=d)
        params = la.get("laplacian").init(jax.random.key(0), num_heads=1, head_dim=d)
        cfg = dict(num_landmarks=48, eps=0.0, inverse="exact", normalize="none", local_window=0)
        med = {
            kernel: float(np.median(np.asarray(lap.laplacian_weights(q, k, params, kernel=kernel,
                                                                      **cfg))))
            for kernel in ("laplace", "gaussian")
        }  # fmt: skip
        print(f"d = {d}: median entry Laplace {med['laplace']:.3f}, Gaussian {med['gaussian']:.3f}")
        assert 0.8 < med["gaussian"] / med["laplace"] < 1.25, med
        assert all(0.05 < m < 0.2 for m in med.values()), med


def test_kernel_option_reaches_every_entry_point():
    """``kernel="laplace"`` is the default (bit for bit); ``"gaussian"`` changes the output
    through the functions, `bind` and the Flax modules (linen, nnx) alike; anything else is
    a ValueError naming ``kernel`` and the accepted values."""
    from flax import nnx

    q, k, v = _inputs(31, tq=8)
    p = _params("laplacian")
    cfg = dict(num_landmarks=4)
    base = lap.laplacian_attention(q, k, v, p, **cfg)
    assert np.array_equal(base, lap.laplacian_attention(q, k, v, p, kernel="laplace", **cfg))
    gauss = lap.laplacian_attention(q, k, v, p, kernel="gaussian", **cfg)
    assert float(jnp.max(jnp.abs(gauss - base))) > 1e-2
    mech = la.get("laplacian").bind(kernel="gaussian", **cfg)
    assert np.array_equal(mech.attention(q, k, v, p), gauss)
    _close(mech.reference(q, k, v, p), gauss, 1e-5, "reference")
    w = lap.laplacian_weights(q, k, p, kernel="gaussian", **cfg)
    _close(jnp.einsum("bhij,bjhd->bihd", w, v), gauss, 1e-5, "weights @ v")
    x = jax.random.normal(jax.random.key(0), (2, 8, 8))
    linen_out, nnx_out = {}, {}
    for kernel in ("laplace", "gaussian"):
        config = {"num_landmarks": 4, "kernel": kernel}
        layer = la.linen.MultiHeadAttention(
            num_heads=2, attention="laplacian", attention_config=tuple(config.items())
        )
        variables = layer.init(jax.random.key(1), x)  # the same params for both kernels
        linen_out[kernel] = layer.apply(variables, x)
        module = la.nn.MultiHeadAttention(
            2, 8, attention="laplacian", attention_config=config, rngs=nnx.Rngs(1)
        )
        nnx_out[kernel] = module(x)
    for out in (linen_out, nnx_out):
        assert float(jnp.max(jnp.abs(out["gaussian"] - out["laplace"]))) > 1e-3
    for bad in ("Gaussian", "l2", None, 1):
        for fn in (lap.laplacian_attention, lap.laplacian_reference, mech.attention):
            with pytest.raises(ValueError, match=r"kernel must be one of \['laplace', 'gaussian'"):
                fn(q, k, v, p, kernel=bad)
        with pytest.raises(ValueError, match="kernel"):
            lap.laplacian_weights(q, k, p, kernel=bad)
    with pytest.raises(ValueError, match="kernel"):
        la.linen.MultiHeadAttention(
            num_heads=2, attention="laplacian", attention_config=(("kernel", "rbf"),)
        ).init(jax.random.key(1), x)


# --------------------------------------------------------------------------- injectivity


def test_injective_separates_queries_that_row_normalisation_merges():
    """Queries a, b with q_b = q_a + 1 * e_0 beyond every key in coordinate 0 have
    |q_b - k_j|_1 = |q_a - k_j|_1 + 1 for every key (and every key landmark), so
    kappa(q_b, .) = exp(-1/lam) kappa(q_a, .): a shift in log space that row
    normalisation removes. "row" gives them the same output; "injective" does not."""
    q, k, v = _inputs(5, b=1, tq=12)
    k = k.at[..., 0].set(jnp.tanh(k[..., 0]))  # keys in (-1, 1) along coordinate 0
    q = q.at[0, 4].set(q[0, 3]).at[0, 3, :, 0].set(2.0).at[0, 4, :, 0].set(3.0)
    params = _params("laplacian")
    cfg = dict(num_landmarks=4, local_window=0)
    row = lap.laplacian_attention(q, k, v, params, normalize="row", **cfg)
    inj = lap.laplacian_attention(q, k, v, params, normalize="injective", **cfg)
    same = float(jnp.max(jnp.abs(row[0, 3] - row[0, 4])))
    diff = float(jnp.min(jnp.max(jnp.abs(inj[0, 3] - inj[0, 4]), axis=-1)))  # per head
    print(f"row: |out_a - out_b| = {same:.2e}; injective: min over heads {diff:.2e}")
    assert same < 1e-5
    assert diff > 1e-2
    # The effective row weights coincide too under "row", and differ under "injective".
    wr = lap.laplacian_weights(q, k, params, normalize="row", **cfg)
    wi = lap.laplacian_weights(q, k, params, normalize="injective", **cfg)
    assert float(jnp.max(jnp.abs(wr[0, :, 3] - wr[0, :, 4]))) < 1e-5
    assert float(jnp.min(jnp.max(jnp.abs(wi[0, :, 3] - wi[0, :, 4]), axis=-1))) > 1e-3


def test_weights_are_the_weights_of_the_output():
    q, k, v = _inputs(6, tq=11, scale=0.8)
    mask = jnp.arange(11)[None, :] < jnp.array([11, 6])[:, None]
    params = _params("laplacian")
    w = lap.laplacian_weights(q, k, params, mask=mask, num_landmarks=4)
    assert float(jnp.max(jnp.abs(jnp.where(mask[:, None, None, :], 0.0, w)))) == 0.0
    out = lap.laplacian_attention(q, k, v, params, mask=mask, num_landmarks=4)
    _close(out, jnp.einsum("bhij,bjhd->bihd", w, v), 1e-5, "weights @ v")


def test_query_dependent_part_does_not_vanish():
    """At the defaults (lambda = d / 2, injective map) on unit-variance q, k, v (T = 256,
    d = 64, m = 16, no local branch), the part of the output that depends on the query,
    out_i - mean_i out_i, has std >= 0.1 std(v) (measured 2.5; the earlier 1/T form gave
    0.00024 at T = 1024). Distinct queries give distinct outputs."""
    q, k, v = _inputs(16, b=1, tq=256, h=1, d=64, dv=8)
    params = la.get("laplacian").init(jax.random.key(0), num_heads=1, head_dim=64)
    out = lap.laplacian_attention(q, k, v, params, num_landmarks=16, local_window=0)
    dep = float(jnp.std(out - jnp.mean(out, axis=1, keepdims=True)))
    print(f"query-dependent std / std(v): {dep / float(jnp.std(v)):.3g}")
    assert dep > 0.1 * float(jnp.std(v))
    flat = np.asarray(out[0, :, 0], np.float64)  # [T, Dv]
    dist = np.abs(flat[:, None] - flat[None]).max(-1) + np.eye(len(flat))
    assert dist.min() > 1e-4


def test_injective_output_sums_to_zero_over_the_sequence():
    """The centring of the injective map makes the global output sum to zero over the valid
    queries of each sequence, whatever the input (a mean-pooling classifier sees it only
    through later nonlinearities); the ``"uncentered"`` ablation keeps a pooled part that
    depends on the input."""
    q, k, v = _inputs(21, tq=12)
    mask = jnp.arange(12)[None, :] < jnp.array([12, 7])[:, None]
    params = _params("laplacian", local_window=0)
    cfg = dict(num_landmarks=4, mask=mask, local_window=0)
    pooled = {}
    for norm in ("injective", "uncentered"):
        for scale in (1.0, 2.0):  # two different values of v
            out = lap.laplacian_attention(q, k, scale * jnp.tanh(v), params, normalize=norm, **cfg)
            valid = mask[:, :, None, None]
            pooled[norm, scale] = np.asarray(jnp.sum(jnp.where(valid, out, 0.0), axis=1))
    size = max(float(np.max(np.abs(pooled["uncentered", s]))) for s in (1.0, 2.0))
    print(f"pooled: injective {np.max(np.abs(pooled['injective', 2.0])):.2e}, uncentred {size:.3g}")
    for scale in (1.0, 2.0):
        assert np.max(np.abs(pooled["injective", scale])) < 1e-4 * size
    change = np.max(np.abs(pooled["uncentered", 2.0] - pooled["uncentered", 1.0]))
    assert change > 0.1 * size


def test_local_branch_is_a_depthwise_convolution():
    """The local branch adds sum_o w[o, h] v[i + o] (zero padded; masked keys are zero) along
    the sequence, and sum_{a,b} w[a, b, h] v[(r + a, c + b)] over the grid (CLS excluded)."""
    q, k, v = _inputs(17, b=1, tq=9)
    params = _params("laplacian", local_window=5)
    cfg = dict(num_landmarks=4)
    on = lap.laplacian_attention(q, k, v, params, local_window=5, **cfg)
    off = lap.laplacian_attention(q, k, v, {"log_lam": params["log_lam"]}, local_window=0, **cfg)
    _close(on - off, _local_np(params["local"], v), 1e-5, "1-D local branch")
    # grid (2, 4) after one CLS token: a 3 x 3 filter over the 2 x 4 image
    pg = _params("laplacian", grid=(2, 4))
    assert pg["local"].shape == (3, 3, H)
    on = lap.laplacian_attention(q, k, v, pg, grid=(2, 4), **cfg)
    off = lap.laplacian_attention(
        q, k, v, {"log_lam": pg["log_lam"]}, grid=(2, 4), local_window=0, **cfg
    )
    img = np.pad(_np(v)[:, 1:].reshape(1, 2, 4, H, 4), ((0, 0), (1, 1), (1, 1), (0, 0), (0, 0)))
    w = _np(pg["local"])
    want = sum(
        w[a, b][None, None, None, :, None] * img[:, a : a + 2, b : b + 4]
        for a in range(3)
        for b in range(3)
    ).reshape(1, 8, H, 4)
    _close(on[:, 1:] - off[:, 1:], want, 1e-5, "2-D local branch")
    _close(on[:, :1], off[:, :1], 1e-6, "CLS has no local term")


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
        padded = mech.attention(q, k.at[:, 5:].set(30.0), v.at[:, 5:].set(1e3), params, mask=mask)
        plain = mech.attention(q, k[:, :5], v[:, :5], params)
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
    q, k, v = _inputs(11, tq=9, scale=0.5, dtype=jnp.bfloat16)
    out = mech.attention(q, k, v, params)
    assert out.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(out, np.float32)))
    ref = mech.attention(*(x.astype(jnp.float32) for x in (q, k, v)), params)
    _close(out, ref, 2e-2, "bf16 vs fp32")
    for scale in (10.0, 100.0 / math.sqrt(D)):  # per-token norms up to ~1e2
        q, k, v = _inputs(12, tq=9, scale=scale)

        def loss(q, k, v, params):
            return jnp.sum(mech.attention(q, k, v, params) ** 2)

        val, grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, params)
        assert np.isfinite(float(val)), f"scale {scale}"
        for g in jax.tree.leaves(grads):
            assert np.all(np.isfinite(g)), f"grad at scale {scale}"


@pytest.mark.slow  # ~13 s of CPU; tests/test_kernels.py covers pallas == xla per kernel
def test_laplacian_pallas_interpret_matches_xla():
    q, k, v = _inputs(15, tq=9)
    params = _params("laplacian")

    def run(impl):
        def loss(q, params):
            out = lap.laplacian_attention(
                q, k, v, params, num_landmarks=4, impl=impl, interpret=impl == "pallas"
            )
            return jnp.sum(out**2), out

        return jax.grad(loss, argnums=(0, 1), has_aux=True)(q, params)

    (gp, out_p), (gx, out_x) = run("pallas"), run("xla")
    _close(out_p, out_x, 1e-5, "pallas forward")
    for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(gx)):
        _close(a, b, 1e-5 * float(np.max(np.abs(b))), "pallas grad")


# --------------------------------------------------------------------------- API and errors


def test_registry_params_and_fixed_lambda():
    assert {"nystromformer", "soft", "laplacian"} <= set(la.names())
    for name in ("nystromformer", "soft", "laplacian"):
        mech = la.get(name)
        assert not mech.supports_causal and not mech.stochastic
        assert mech.fixed_params() == frozenset()
    p = la.get("laplacian").init(jax.random.key(0), num_heads=3, head_dim=16)
    np.testing.assert_allclose(p["log_lam"], np.full(3, math.log(8.0)), rtol=1e-6)  # d / 2
    assert p["local"].shape == (3, 3)
    assert (
        la.get("laplacian").init(
            jax.random.key(0), num_heads=3, head_dim=16, lam=2.0, local_window=0
        )
        == {}
    )
    # A fixed lam equals the learnable one set to the same value.
    q, k, v = _inputs(13, tq=8)
    fixed = lap.laplacian_attention(q, k, v, {}, lam=1.5, num_landmarks=4, local_window=0)
    learn = lap.laplacian_attention(
        q, k, v, {"log_lam": jnp.full((H,), math.log(1.5))}, num_landmarks=4, local_window=0
    )
    _close(fixed, learn, 1e-5, "fixed lam")


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
