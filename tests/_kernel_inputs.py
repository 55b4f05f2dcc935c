"""Tolerances and inputs shared by the kernel tests (tests/test_l1_distance.py,
tests/test_newton_schulz.py, tests/test_kernels.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import kernels

ON_GPU = jax.default_backend() == "gpu"


# Relative tolerances (of the largest reference magnitude) keyed by input dtype. Both paths
# compute in float32 after the cast, so bf16 only loosens the comparison of bf16 gradients.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


# ((B, H, N, M, D), block sizes): N, M not multiples of the blocks (default 64 x 64, or 16 x 32
# and 16 x 16 with more programs per (batch, head)); D in {16, 33, 64, 128}. Block sizes only
# matter to the Pallas path.
SMALL_BLOCKS = kernels.BlockSizes(block_n=16, block_m=32, block_d=8)


def _assert_close(actual, expected, dtype, msg="", scale=None):
    """max|actual - expected| <= TOL[dtype] * scale; scale defaults to max|expected|."""
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    expected = np.asarray(jnp.asarray(expected, jnp.float32))
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert np.all(np.isfinite(actual)), msg
    if scale is None:
        scale = float(np.max(np.abs(expected)))
    scale = max(scale, 1e-30)
    err = float(np.max(np.abs(actual - expected))) / scale
    assert err <= TOL[dtype], f"{msg}: relative error {err:.3g} > {TOL[dtype]}"


def _xy(shape, dtype, seed=0):
    b, h, n, m, d = shape
    kx, ky, kw, kl = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, (b, h, n, d), jnp.float32).astype(dtype)
    y = jax.random.normal(ky, (b, h, m, d), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (b, h, n, m), jnp.float32)  # random linear functional
    lam = jnp.sqrt(float(d)) * jnp.exp(0.3 * jax.random.normal(kl, (h,), jnp.float32))
    return x, y, w, lam


D_TOKENS = 16


def _tokens(kind: str, b: int, h: int, m: int, seed: int = 0):
    """Landmark-like tokens [B, H, m, 16]: random, near-duplicate clusters or collapsed."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    if kind == "random":
        return jax.random.normal(k1, (b, h, m, D_TOKENS))
    if kind.startswith("dup"):  # m / c distinct centres, each repeated c times + 1e-3 noise
        c = int(kind[3:])
        centres = jax.random.normal(k1, (b, h, m // c, D_TOKENS))
        noise = 1e-3 * jax.random.normal(k2, (b, h, m, D_TOKENS))
        return jnp.repeat(centres, c, axis=2) + noise
    if kind == "collapsed":  # all tokens within ~0.05 of each other: kernel matrix ~ all ones
        return 0.05 * jax.random.normal(k1, (b, h, m, D_TOKENS))
    raise AssertionError(kind)


def _kernel_matrix(kernel: str, x):
    """Laplace (lambda = sqrt(d)) or Gaussian (SOFT scaling x d^-1/4) kernel matrix [B,H,m,m]."""
    if kernel == "laplace":
        return kernels.laplace_kernel_reference(x, x, D_TOKENS**0.5)
    xs = x * D_TOKENS**-0.25
    sq = jnp.sum((xs[:, :, :, None, :] - xs[:, :, None, :, :]) ** 2, axis=-1)
    return jnp.exp(-0.5 * sq)


def _residual_stats(a, v, eps=0.01):
    """Per matrix: max|PV - I|, spectral |PV - I|, predicted spectral residual, cond(P).

    P symmetric => every V_k is a polynomial in P and I - P V_{k+1} = (I - P V_k)^2, so
    |I - P V_K|_2 = max_mu |1 - alpha mu^2|^(2^K) over the eigenvalues mu of P (float64 here).
    """
    a = np.asarray(a, np.float64).reshape(-1, a.shape[-2], a.shape[-1])
    v = np.asarray(v, np.float64).reshape(a.shape)
    eye = np.eye(a.shape[-1])
    out = []
    for ai, vi in zip(a, v):
        p = ai + eps * eye
        r = p @ vi - eye
        mu = np.linalg.eigvalsh(p)
        absp = np.abs(p)
        alpha = 1.8 / (absp.sum(1).max() * absp.sum(0).max())
        pred = float(np.max(np.abs(1.0 - alpha * mu**2)) ** (2**20))
        out.append((np.abs(r).max(), np.linalg.norm(r, 2), pred, mu.max() / mu.min()))
    return out
