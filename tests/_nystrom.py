"""Inputs, cases and float64 numpy oracles shared by the tests of the Nystrom family
(nystromformer, soft, laplacian over `linattn_jax.nystrom_core`): the full ``T x T`` kernel
matrices (Laplace, Gaussian, softmax) and the Nystrom estimate from given landmarks, written
independently of the library."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

import linattn_jax as la
from linattn_jax import laplacian as lap
from linattn_jax import nystrom_core
from linattn_jax import nystromformer as nf
from linattn_jax import soft as sf

H, D = 2, 8

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


def _segment_landmarks(q, k):
    """Segment means of q and k (T = 10, m = 4: segments of sizes 3, 2, 3, 2), numpy."""
    seg = np.array([0, 0, 0, 1, 1, 2, 2, 2, 3, 3])  # floor(r * 4 / 10)
    onehot = (seg[:, None] == np.arange(4)).astype(np.float64)
    avg = onehot / onehot.sum(0)
    return tuple(np.einsum("tl,bthd->blhd", avg, _np(x)) for x in (q, k))
