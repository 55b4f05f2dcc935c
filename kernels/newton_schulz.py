"""Batched Newton-Schulz inverse of regularised kernel matrices (SPEC section 4).

For each (batch, head) matrix A (m x m), with P = A + eps I:

    alpha   = 1.8 / (max_i sum_j |P_ij| * max_j sum_i |P_ij|)
    V_0     = alpha P^T
    V_{k+1} = 2 V_k - V_k P V_k                                   (k = 0 .. iters-1)

The official SOFT / LaplacianFormer recipe is alpha = 1.8 / (max_i sum_j |A_ij|)^2 for a
symmetric A. We always use the product of the max row sum and max column sum, which equals
that square for a symmetric matrix and, for a non-symmetric A (separate query and key
landmarks), still bounds sigma_max(P)^2 <= |P|_1 |P|_inf, so alpha sigma_max^2 <= 1.8 < 2 and
the iteration converges for any non-singular P. We take the norms of P (not A) so that bound
holds exactly; the two differ by at most eps in each sum.

Convergence: for symmetric P every V_k is a polynomial in P and I - P V_{k+1} = (I - P V_k)^2,
so |I - P V_K|_2 = max_mu |1 - alpha mu^2|^(2^K) over the eigenvalues mu >= eps of P. The
iteration starts to converge after about log2(1 / (alpha mu_min^2)) steps and reaches float32
accuracy ~4 steps later. For a non-symmetric P the same holds with singular values, but
float32 rounding grows with the condition number: past ~1e5 the residual stalls or diverges.
``python -m kernels.bench --residual-only`` prints max|PV - I| against the iterations on
landmark matrices like the mechanisms build (segment means of 1024 unit-Gaussian tokens,
m = 64, Laplace kernel at lambda = d / 2): the symmetric A = kappa(K~, K~) (sigma_min(P) 0.21,
sigma_max 37) converges in 20 steps (4.7e-6); the non-symmetric A = kappa(Q~, K~) (sigma_min
2.8e-5) is still at 0.3 after 20 steps, 0.08 after 30 and diverges in float32 after 40 (2.1,
then 12 at 60). Hence laplacian's shared landmarks (linattn_jax/laplacian.py). With
near-duplicate landmarks the max row sum grows to the cluster size (up to m when all
landmarks coincide) while mu_min stays ~eps = 0.01, so 20 steps only converge when
max_row_sum(P) <~ 3.6; otherwise the directions of the smallest eigenvalues are left
under-inverted (V acts as a damped inverse there). tests/test_newton_schulz.py checks the residual
against the formula above.

alpha depends on A only through a max: it is treated as a constant (no gradient).

Gradient: the custom VJP treats V as the exact inverse of P, dL/dA = -V^T G V^T (the gradient
of A -> (A + eps I)^-1 evaluated at the Newton-Schulz approximation V), not the derivative of
the truncated iteration. `newton_schulz_inverse_reference` is the plain jnp iteration, which
``jax.grad`` differentiates step by step instead.

Implementations: ``"pallas"`` runs one program per (batch, head), m <= 256, the matrix
zero-padded to a power of 2 >= 16, float32 ``jnp.dot`` with precision HIGHEST (no TF32) and a
``lax.fori_loop`` over the steps. Up to 64 x 64 the whole matrix is held on chip; above, the
program keeps P, V, V P in HBM buffers and multiplies 64 x 64 tiles (phases separated by a
block barrier). Zero padding keeps the iteration block-diagonal: the padded block of V stays
exactly 0. ``"xla"`` is the same iteration as batched einsums.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from kernels import _dispatch

MAX_PALLAS_SIZE = 256  # largest m the one-program-per-matrix kernel accepts
_MIN_PAD = 16  # Triton dots need every dimension >= 16
# Matrices up to _TILE x _TILE are held on chip whole; bigger ones are iterated tile by tile
# (a 256 x 256 float32 operand alone is 256 KiB, more than an SM's shared memory).
_TILE = 64
_HI = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class _Config:
    impl: str  # "xla" | "pallas"
    iters: int
    interpret: bool


def _alpha(p_abs_row_sums, p_abs_col_sums):
    denom = jnp.max(p_abs_row_sums, axis=-1) * jnp.max(p_abs_col_sums, axis=-1)
    # P = A + eps I is never 0 for eps > 0; the floor only keeps eps = 0, A = 0 finite.
    return 1.8 / jnp.maximum(denom, jnp.finfo(jnp.float32).tiny)


# ---------------------------------------------------------------------------------------------
# Pallas kernel
# ---------------------------------------------------------------------------------------------


def _ns_kernel(p_ref, v_ref, *, iters: int):
    """Newton-Schulz on one zero-padded ``[m_pad, m_pad]`` matrix P; writes V."""
    p = p_ref[...]  # [m_pad, m_pad] float32
    p_abs = jnp.abs(p)
    alpha = _alpha(jnp.sum(p_abs, axis=1), jnp.sum(p_abs, axis=0))  # scalar
    v = alpha * p.T  # [m_pad, m_pad]

    def body(_, v):
        vp = jnp.dot(v, p, precision=_HI, preferred_element_type=jnp.float32)  # [m_pad, m_pad]
        return 2.0 * v - jnp.dot(vp, v, precision=_HI, preferred_element_type=jnp.float32)

    v_ref[...] = lax.fori_loop(0, iters, body, v)


def _tiled_ns_kernel(p_ref, v_ref, w_ref, x_ref, *, iters: int, tile: int, barrier: bool):
    """Newton-Schulz on one ``[m_pad, m_pad]`` matrix too big to hold on chip (m_pad > 64).

    P stays in its (HBM) ref; V, W = V P and the next V (x_ref) live in three output buffers of
    the same program and are updated ``tile x tile`` at a time. Every phase reads what the
    previous one wrote in other tiles, hence the block-wide barrier between phases on GPU
    (__syncthreads also makes the global writes visible); the interpreter runs in order.
    """
    n_tiles = p_ref.shape[0] // tile

    def sync():
        if barrier:
            pl_triton.debug_barrier()

    def tile_ds(i):
        return pl.ds(pl.multiple_of(i * tile, tile), tile)

    def tile_matmul(a_ref, b_ref, i, j):
        def body(k, acc):
            a = a_ref[tile_ds(i), tile_ds(k)]  # [tile, tile]
            b = b_ref[tile_ds(k), tile_ds(j)]  # [tile, tile]
            return acc + jnp.dot(a, b, precision=_HI, preferred_element_type=jnp.float32)

        return lax.fori_loop(0, n_tiles, body, jnp.zeros((tile, tile), jnp.float32))

    def for_each_tile(fn):
        def row(i, carry):
            def col(j, carry):
                fn(i, j)
                return carry

            return lax.fori_loop(0, n_tiles, col, carry)

        lax.fori_loop(0, n_tiles, row, 0)
        sync()

    def abs_sum_max(axis):  # max over rows (axis=1) or columns (axis=0) of the |P| sums
        def outer(i, best):
            def inner(k, acc):
                blk = p_ref[tile_ds(i), tile_ds(k)] if axis == 1 else p_ref[tile_ds(k), tile_ds(i)]
                return acc + jnp.sum(jnp.abs(blk), axis=axis)  # [tile]

            sums = lax.fori_loop(0, n_tiles, inner, jnp.zeros((tile,), jnp.float32))
            return jnp.maximum(best, jnp.max(sums))

        return lax.fori_loop(0, n_tiles, outer, jnp.float32(0.0))

    alpha = 1.8 / jnp.maximum(abs_sum_max(1) * abs_sum_max(0), jnp.finfo(jnp.float32).tiny)

    def init(i, j):
        v_ref[tile_ds(i), tile_ds(j)] = alpha * p_ref[tile_ds(j), tile_ds(i)].T

    for_each_tile(init)

    def step(_, carry):
        def vp(i, j):
            w_ref[tile_ds(i), tile_ds(j)] = tile_matmul(v_ref, p_ref, i, j)

        def update(i, j):
            v_ij = v_ref[tile_ds(i), tile_ds(j)]
            x_ref[tile_ds(i), tile_ds(j)] = 2.0 * v_ij - tile_matmul(w_ref, v_ref, i, j)

        def copy(i, j):
            v_ref[tile_ds(i), tile_ds(j)] = x_ref[tile_ds(i), tile_ds(j)]

        for_each_tile(vp)  # W = V P
        for_each_tile(update)  # X = 2 V - W V
        for_each_tile(copy)  # V = X
        return carry

    lax.fori_loop(0, iters, step, 0)


def _ns_pallas(p, iters: int, interpret: bool, *, tile: int = _TILE):
    bh, m, _ = p.shape
    m_pad = max(_MIN_PAD, _dispatch.next_power_of_2(m))
    pp = _dispatch.pad_axis(_dispatch.pad_axis(p, 1, m_pad), 2, m_pad)  # [BH, m_pad, m_pad]
    spec = pl.BlockSpec((None, m_pad, m_pad), lambda b: (b, 0, 0))
    out_shape = jax.ShapeDtypeStruct((bh, m_pad, m_pad), jnp.float32)
    if m_pad <= tile:
        kernel = functools.partial(_ns_kernel, iters=iters)
        n_out = 1
    else:
        kernel = functools.partial(_tiled_ns_kernel, iters=iters, tile=tile, barrier=not interpret)
        n_out = 3  # V and two scratch buffers
    outs = pl.pallas_call(
        kernel,
        out_shape=[out_shape] * n_out,
        grid=(bh,),
        in_specs=[spec],
        out_specs=[spec] * n_out,
        interpret=interpret,
        # Triton, not the Mosaic GPU default of jax >= 0.8.
        compiler_params=pl_triton.CompilerParams(num_warps=4),
        name="newton_schulz_inverse",
    )(pp)
    return outs[0][:, :m, :m]


# ---------------------------------------------------------------------------------------------
# jnp iteration (the xla path and the reference)
# ---------------------------------------------------------------------------------------------


def _ns_jnp(p, iters: int):
    """Newton-Schulz on ``[..., m, m]`` float32 P."""
    p_abs = jnp.abs(p)
    alpha = lax.stop_gradient(_alpha(jnp.sum(p_abs, axis=-1), jnp.sum(p_abs, axis=-2)))  # [...]
    v = alpha[..., None, None] * jnp.swapaxes(p, -1, -2)

    def body(_, v):
        vp = jnp.einsum("...ij,...jk->...ik", v, p, precision=_HI)
        return 2.0 * v - jnp.einsum("...ij,...jk->...ik", vp, v, precision=_HI)

    return lax.fori_loop(0, iters, body, v)


# ---------------------------------------------------------------------------------------------
# custom_vjp on P [BH, m, m] float32
# ---------------------------------------------------------------------------------------------


def _ns_forward(p, cfg: _Config):
    if cfg.impl == "pallas":
        return _ns_pallas(p, cfg.iters, cfg.interpret)
    return _ns_jnp(p, cfg.iters)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _ns(p, cfg: _Config):
    return _ns_forward(p, cfg)


def _ns_fwd(p, cfg):
    v = _ns_forward(p, cfg)
    return v, v


def _ns_bwd(cfg, v, g):
    # d(P^-1) = -P^-1 dP P^-1  =>  dL/dP = -P^-T G P^-T, with V standing in for P^-1.
    vt = jnp.swapaxes(v, -1, -2)
    gvt = jnp.einsum("bij,bjk->bik", g, vt, precision=_HI)
    return (-jnp.einsum("bij,bjk->bik", vt, gvt, precision=_HI),)


_ns.defvjp(_ns_fwd, _ns_bwd)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def _check(name: str, a, iters, eps) -> None:
    _dispatch.check_rank(name, "a", a, 4)
    _dispatch.check_float(name, "a", a)
    if a.shape[2] != a.shape[3]:
        raise ValueError(f"{name}: a must be [B, H, m, m] (square), got {a.shape=}")
    if isinstance(iters, bool) or not isinstance(iters, numbers.Integral) or iters < 1:
        raise ValueError(f"{name}: iters must be an int >= 1, got {iters=!r}")
    if not isinstance(eps, numbers.Real) or not 0.0 <= float(eps) < float("inf"):
        raise ValueError(f"{name}: eps must be a finite float >= 0, got {eps=!r}")


def _regularise(a, eps: float):
    m = a.shape[-1]
    eye = jnp.eye(m, dtype=jnp.float32).reshape((1,) * (a.ndim - 2) + (m, m))
    return a.astype(jnp.float32) + eps * eye


def newton_schulz_inverse(
    a: jax.Array,
    *,
    iters: int = 20,
    eps: float = 0.01,
    impl: str = "auto",
    interpret: bool = False,
) -> jax.Array:
    """Approximate ``(A + eps I)^-1`` for a batch of kernel matrices by Newton-Schulz.

    Args:
      a: ``[B, H, m, m]`` floating (computed in float32).
      iters: number of Newton-Schulz steps (>= 1); SPEC default 20.
      eps: ridge added to the diagonal (SPEC: 0.01).
      impl: ``"auto"`` (Pallas on GPU, else xla), ``"xla"`` or ``"pallas"`` (needs m <= 256).
      interpret: run the Pallas kernel in the interpreter (CPU tests); only for ``"pallas"``.

    Returns:
      V ``[B, H, m, m]`` float32. Gradient: dL/dA = -V^T G V^T (the exact-inverse rule at V).
    """
    name = "newton_schulz_inverse"
    _check(name, a, iters, eps)
    impl = _dispatch.resolve_impl(name, impl)
    b, h, m, _ = a.shape
    if impl == "pallas" and m > MAX_PALLAS_SIZE:
        raise ValueError(
            f'{name}: impl="pallas" runs one program per matrix and supports '
            f'm <= {MAX_PALLAS_SIZE}, got {a.shape=}; use impl="xla"'
        )
    cfg = _Config(impl=impl, iters=int(iters), interpret=bool(interpret))
    p = _regularise(a, float(eps)).reshape(b * h, m, m)
    return _ns(p, cfg).reshape(b, h, m, m)


def newton_schulz_inverse_reference(
    a: jax.Array, *, iters: int = 20, eps: float = 0.01
) -> jax.Array:
    """Plain jnp oracle of `newton_schulz_inverse` (autodiff goes through every step)."""
    _check("newton_schulz_inverse_reference", a, iters, eps)
    return _ns_jnp(_regularise(a, float(eps)), int(iters))
