"""Pairwise L1 distance and Laplace kernel matrix, as Pallas kernels with a jnp reference.

    out[b, h, i, j] = sum_d |x[b, h, i, d] - y[b, h, j, d]|          (l1_distance)
    K[b, h, i, j]   = exp(-out[b, h, i, j] / lam[b, h])               (laplace_kernel)

The Laplace kernel kappa(q, k) = exp(-|q - k|_1 / lambda) is the similarity of
LaplacianFormer (seed 003, SPEC section 4 "laplacian"). Everything is computed and returned in
float32 whatever the input dtype.

Layout: the op works on ``[B, H, N, D]`` / ``[B, H, M, D]`` (batch and heads first, as the
Nystrom landmark matrices are built); callers with ``[B, T, H, D]`` transpose first.

Implementations (``impl``):

* ``"pallas"``: forward kernel tiled over ``(B*H, N blocks, M blocks)``, each program holding a
  ``[block_n, block_m]`` float32 accumulator and looping over D in chunks of ``block_d``; the
  Laplace variant fuses ``exp(-d / lam)`` as an epilogue so the distance matrix is never written.
  The backward (sign form, below) is two more Pallas kernels, one for dx and one for dy, tiled
  over ``(B*H, rows, D chunks)`` and looping over the other side's rows. N, M, D are zero-padded
  to the block sizes and the padding is sliced off (zero D-padding adds |0 - 0| = 0).
  The kernels are lowered with Triton (``compiler_params``; a plain ``pallas_call`` would go to
  Mosaic GPU in jax >= 0.8). The tests check that they lower to Triton for CUDA; they have not
  yet been compiled and run on a GPU.
* ``"xla"``: the same math in jnp, chunked over D with ``lax.scan`` so that no ``[N, M, D]``
  array is materialised (peak memory ``B * H * N * M * 8`` floats).
* ``"auto"``: ``"pallas"`` on GPU, ``"xla"`` elsewhere.

Gradients (``jax.custom_vjp``, identical for both implementations), with s_ijd =
sign(x_id - y_jd) and g = dL/d out:

    dL/dx_id =  sum_j g_ij s_ijd,      dL/dy_jd = -sum_i g_ij s_ijd.

sign(0) = 0: at an exact tie x_id == y_jd the subgradient 0 is used (``jax.grad`` of
``jnp.abs`` would use +1 for x and -1 for y there). For the Laplace kernel, with G = dL/dK,
the distance cotangent is -G K / lam and

    dL/dlam = sum_ij G_ij K_ij d_ij / lam^2 = -sum_ij G_ij K_ij log(K_ij) / lam,

which needs only K (the fused forward never writes d); K log K is taken as 0 where K underflows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from kernels import _dispatch

# Chunk of the feature axis per lax.scan step on the xla path (peak memory N * M * this).
_XLA_CHUNK_D = 8
# Smallest row block: tiny N or M get a block of next_power_of_2(N) >= this, not block_n.
_MIN_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the L1 / Laplace kernels (all powers of 2, as Triton requires).

    Attributes:
      block_n: rows of x per program.
      block_m: rows of y per program.
      block_d: feature chunk per inner step; each step materialises a
        ``[block_n, block_m, block_d]`` float32 temporary (16K values = 128 registers per
        thread at the defaults with 4 warps). D is padded to a multiple of it.
      num_warps: Triton warps per program (GPU only).

    The defaults are chosen for register pressure, not tuned on hardware.
    """

    block_n: int = 64
    block_m: int = 64
    block_d: int = 4
    num_warps: int = 4

    @classmethod
    def get_default(cls) -> BlockSizes:
        return cls()


@dataclasses.dataclass(frozen=True)
class _Config:
    impl: str  # "xla" | "pallas"
    block_sizes: BlockSizes
    interpret: bool


# ---------------------------------------------------------------------------------------------
# Pallas kernels (bodies on refs)
# ---------------------------------------------------------------------------------------------


def _forward_kernel(x_ref, y_ref, *rest, block_d: int, num_d_blocks: int, laplace: bool):
    """One ``[block_n, block_m]`` tile of the distance (or, fused, of the Laplace kernel)."""
    if laplace:
        inv_lam_ref, o_ref = rest
    else:
        (o_ref,) = rest
    block_n = x_ref.shape[0]
    block_m = y_ref.shape[0]

    def body(c, acc):
        dsl = pl.ds(pl.multiple_of(c * block_d, block_d), block_d)
        xs = x_ref[:, dsl]  # [block_n, block_d]
        ys = y_ref[:, dsl]  # [block_m, block_d]
        diff = xs[:, None, :] - ys[None, :, :]  # [block_n, block_m, block_d]
        return acc + jnp.sum(jnp.abs(diff), axis=2)  # [block_n, block_m]

    acc = lax.fori_loop(0, num_d_blocks, body, jnp.zeros((block_n, block_m), jnp.float32))
    if laplace:
        acc = jnp.exp(-acc * inv_lam_ref[...])  # inv_lam_ref: [1, 1]
    o_ref[...] = acc


def _dx_kernel(g_ref, x_ref, y_ref, dx_ref, *, block_m: int, num_m_blocks: int):
    """dx[i, c] = sum_j g[i, j] sign(x[i, c] - y[j, c]) for one (row block, D chunk)."""
    xs = x_ref[...]  # [block_n, block_d]

    def body(j, acc):
        msl = pl.ds(pl.multiple_of(j * block_m, block_m), block_m)
        ys = y_ref[msl, :]  # [block_m, block_d]
        g = g_ref[:, msl]  # [block_n, block_m]
        s = jnp.sign(xs[:, None, :] - ys[None, :, :])  # [block_n, block_m, block_d]
        return acc + jnp.sum(g[:, :, None] * s, axis=1)  # [block_n, block_d]

    dx_ref[...] = lax.fori_loop(0, num_m_blocks, body, jnp.zeros(xs.shape, jnp.float32))


def _dy_kernel(g_ref, x_ref, y_ref, dy_ref, *, block_n: int, num_n_blocks: int):
    """dy[j, c] = -sum_i g[i, j] sign(x[i, c] - y[j, c]) for one (row block, D chunk)."""
    ys = y_ref[...]  # [block_m, block_d]

    def body(i, acc):
        nsl = pl.ds(pl.multiple_of(i * block_n, block_n), block_n)
        xs = x_ref[nsl, :]  # [block_n, block_d]
        g = g_ref[nsl, :]  # [block_n, block_m]
        s = jnp.sign(xs[:, None, :] - ys[None, :, :])  # [block_n, block_m, block_d]
        return acc - jnp.sum(g[:, :, None] * s, axis=0)  # [block_m, block_d]

    dy_ref[...] = lax.fori_loop(0, num_n_blocks, body, jnp.zeros(ys.shape, jnp.float32))


# ---------------------------------------------------------------------------------------------
# pallas_call wrappers: [BH, N, D] float32 in, padding handled here
# ---------------------------------------------------------------------------------------------


def _compiler_params(bs: BlockSizes):
    # jax >= 0.8 lowers a plain pallas_call to Mosaic GPU; these kernels are written for Triton.
    return pl_triton.CompilerParams(num_warps=bs.num_warps)


def _row_block(block: int, n: int) -> int:
    return min(block, max(_MIN_BLOCK, _dispatch.next_power_of_2(n)))


def _padded_sizes(n: int, m: int, d: int, bs: BlockSizes):
    bn, bm = _row_block(bs.block_n, n), _row_block(bs.block_m, m)
    return (
        bn,
        bm,
        _dispatch.round_up(n, bn),
        _dispatch.round_up(m, bm),
        _dispatch.round_up(d, bs.block_d),
    )


def _forward_pallas(x, y, inv_lam, bs: BlockSizes, interpret: bool):
    bh, n, d = x.shape
    m = y.shape[1]
    bn, bm, n_p, m_p, d_p = _padded_sizes(n, m, d, bs)
    xp = _dispatch.pad_axis(_dispatch.pad_axis(x, 1, n_p), 2, d_p)  # [BH, Np, Dp]
    yp = _dispatch.pad_axis(_dispatch.pad_axis(y, 1, m_p), 2, d_p)  # [BH, Mp, Dp]
    in_specs = [
        pl.BlockSpec((None, bn, d_p), lambda b, i, j: (b, i, 0)),
        pl.BlockSpec((None, bm, d_p), lambda b, i, j: (b, j, 0)),
    ]
    args = [xp, yp]
    if inv_lam is not None:
        in_specs.append(pl.BlockSpec((None, 1, 1), lambda b, i, j: (b, 0, 0)))
        args.append(inv_lam.reshape(bh, 1, 1))
    kernel = functools.partial(
        _forward_kernel,
        block_d=bs.block_d,
        num_d_blocks=d_p // bs.block_d,
        laplace=inv_lam is not None,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((bh, n_p, m_p), jnp.float32),
        grid=(bh, n_p // bn, m_p // bm),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bn, bm), lambda b, i, j: (b, i, j)),
        interpret=interpret,
        compiler_params=_compiler_params(bs),
        name="laplace_kernel" if inv_lam is not None else "l1_distance",
    )(*args)
    return out[:, :n, :m]


def _backward_pallas(x, y, g, bs: BlockSizes, interpret: bool):
    bh, n, d = x.shape
    m = y.shape[1]
    bn, bm, n_p, m_p, d_p = _padded_sizes(n, m, d, bs)
    bd = bs.block_d
    xp = _dispatch.pad_axis(_dispatch.pad_axis(x, 1, n_p), 2, d_p)  # [BH, Np, Dp]
    yp = _dispatch.pad_axis(_dispatch.pad_axis(y, 1, m_p), 2, d_p)  # [BH, Mp, Dp]
    # Zero cotangent on padded rows/columns: they contribute nothing to dx, dy.
    gp = _dispatch.pad_axis(_dispatch.pad_axis(g, 1, n_p), 2, m_p)  # [BH, Np, Mp]
    dx = pl.pallas_call(
        functools.partial(_dx_kernel, block_m=bm, num_m_blocks=m_p // bm),
        out_shape=jax.ShapeDtypeStruct((bh, n_p, d_p), jnp.float32),
        grid=(bh, n_p // bn, d_p // bd),
        in_specs=[
            pl.BlockSpec((None, bn, m_p), lambda b, i, c: (b, i, 0)),
            pl.BlockSpec((None, bn, bd), lambda b, i, c: (b, i, c)),
            pl.BlockSpec((None, m_p, bd), lambda b, i, c: (b, 0, c)),
        ],
        out_specs=pl.BlockSpec((None, bn, bd), lambda b, i, c: (b, i, c)),
        interpret=interpret,
        compiler_params=_compiler_params(bs),
        name="l1_distance_dx",
    )(gp, xp, yp)
    dy = pl.pallas_call(
        functools.partial(_dy_kernel, block_n=bn, num_n_blocks=n_p // bn),
        out_shape=jax.ShapeDtypeStruct((bh, m_p, d_p), jnp.float32),
        grid=(bh, m_p // bm, d_p // bd),
        in_specs=[
            pl.BlockSpec((None, n_p, bm), lambda b, j, c: (b, 0, j)),
            pl.BlockSpec((None, n_p, bd), lambda b, j, c: (b, 0, c)),
            pl.BlockSpec((None, bm, bd), lambda b, j, c: (b, j, c)),
        ],
        out_specs=pl.BlockSpec((None, bm, bd), lambda b, j, c: (b, j, c)),
        interpret=interpret,
        compiler_params=_compiler_params(bs),
        name="l1_distance_dy",
    )(gp, xp, yp)
    return dx[:, :n, :d], dy[:, :m, :d]


# ---------------------------------------------------------------------------------------------
# xla path: D-chunked jnp, never materialises [N, M, D]
# ---------------------------------------------------------------------------------------------


def _d_chunks(x, chunk: int):
    """[BH, N, D] -> [D/chunk, BH, N, chunk] (D zero-padded to a multiple of chunk)."""
    bh, n, d = x.shape
    d_p = _dispatch.round_up(d, chunk)
    x = _dispatch.pad_axis(x, 2, d_p).reshape(bh, n, d_p // chunk, chunk)
    return jnp.moveaxis(x, 2, 0)


def _forward_xla(x, y, inv_lam):
    def step(acc, xy):
        xc, yc = xy  # [BH, N, c], [BH, M, c]
        diff = xc[:, :, None, :] - yc[:, None, :, :]  # [BH, N, M, c]
        return acc + jnp.sum(jnp.abs(diff), axis=3), None

    init = jnp.zeros((x.shape[0], x.shape[1], y.shape[1]), jnp.float32)
    out, _ = lax.scan(step, init, (_d_chunks(x, _XLA_CHUNK_D), _d_chunks(y, _XLA_CHUNK_D)))
    if inv_lam is not None:
        out = jnp.exp(-out * inv_lam[:, None, None])
    return out


def _backward_xla(x, y, g):
    hi = lax.Precision.HIGHEST  # no TF32 on GPU: the sign sums must be exact-ish

    def step(_, xy):
        xc, yc = xy
        s = jnp.sign(xc[:, :, None, :] - yc[:, None, :, :])  # [BH, N, M, c]
        dx = jnp.einsum("bnm,bnmc->bnc", g, s, precision=hi)  # [BH, N, c]
        dy = -jnp.einsum("bnm,bnmc->bmc", g, s, precision=hi)  # [BH, M, c]
        return None, (dx, dy)

    _, (dx, dy) = lax.scan(step, None, (_d_chunks(x, _XLA_CHUNK_D), _d_chunks(y, _XLA_CHUNK_D)))

    def unchunk(z, like):  # [D/c, BH, R, c] -> [BH, R, D]
        z = jnp.moveaxis(z, 0, 2)
        return z.reshape(z.shape[0], z.shape[1], -1)[:, :, : like.shape[2]]

    return unchunk(dx, x), unchunk(dy, y)


def _forward(x, y, inv_lam, cfg: _Config):
    if cfg.impl == "pallas":
        return _forward_pallas(x, y, inv_lam, cfg.block_sizes, cfg.interpret)
    return _forward_xla(x, y, inv_lam)


def _backward(x, y, g, cfg: _Config):
    if cfg.impl == "pallas":
        return _backward_pallas(x, y, g, cfg.block_sizes, cfg.interpret)
    return _backward_xla(x, y, g)


# ---------------------------------------------------------------------------------------------
# custom_vjp on [BH, N, D] float32
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _l1(x, y, cfg: _Config):
    return _forward(x, y, None, cfg)


def _l1_fwd(x, y, cfg):
    return _forward(x, y, None, cfg), (x, y)


def _l1_bwd(cfg, res, g):
    x, y = res
    return _backward(x, y, g, cfg)


_l1.defvjp(_l1_fwd, _l1_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _laplace(x, y, lam, cfg: _Config):
    return _forward(x, y, 1.0 / lam, cfg)


def _laplace_fwd(x, y, lam, cfg):
    k = _forward(x, y, 1.0 / lam, cfg)
    return k, (x, y, lam, k)


def _laplace_bwd(cfg, res, g):
    x, y, lam, k = res  # lam: [BH]; k: [BH, N, M]
    gk = g * k
    dx, dy = _backward(x, y, -gk / lam[:, None, None], cfg)
    # K log K -> 0 as K -> 0; the where keeps log(0) out.
    k_log_k = jnp.where(k > 0, k * jnp.log(jnp.where(k > 0, k, 1.0)), 0.0)
    dlam = -jnp.sum(g * k_log_k, axis=(1, 2)) / lam
    return dx, dy, dlam


_laplace.defvjp(_laplace_fwd, _laplace_bwd)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def _check_xy(name: str, x, y) -> None:
    _dispatch.check_rank(name, "x", x, 4)
    _dispatch.check_rank(name, "y", y, 4)
    _dispatch.check_float(name, "x", x)
    _dispatch.check_float(name, "y", y)
    if x.shape[:2] != y.shape[:2] or x.shape[3] != y.shape[3]:
        raise ValueError(
            f"{name}: x [B, H, N, D] and y [B, H, M, D] must agree in B, H and D, "
            f"got {x.shape=} and {y.shape=}"
        )


def _config(name: str, impl: str, interpret: bool, block_sizes: BlockSizes | None) -> _Config:
    impl = _dispatch.resolve_impl(name, impl)
    bs = BlockSizes.get_default() if block_sizes is None else block_sizes
    if not isinstance(bs, BlockSizes):
        raise ValueError(f"{name}: block_sizes must be a BlockSizes, got {type(bs).__name__}")
    for field in ("block_n", "block_m", "block_d"):
        value = getattr(bs, field)
        if not _dispatch.is_power_of_2(value):
            raise ValueError(f"{name}: block_sizes.{field}={value} must be a power of 2")
    return _Config(impl=impl, block_sizes=bs, interpret=bool(interpret))


def _flatten(x):
    return x.astype(jnp.float32).reshape(-1, x.shape[2], x.shape[3])


def _broadcast_lam(name: str, lam, b: int, h: int) -> jax.Array:
    """lam of shape [], [H], [B, H] (or anything broadcastable to it) or [B, H, 1, 1] -> [B, H].

    A rank-1 lam is per head (it is NOT broadcast against the last axis numpy-style).
    """
    lam = jnp.asarray(lam)
    if not jnp.issubdtype(lam.dtype, jnp.floating):
        lam = lam.astype(jnp.float32)
    shape = lam.shape
    if lam.ndim == 1:
        lam = lam[None, :]
    elif lam.ndim == 4:
        if shape[2:] != (1, 1):
            raise ValueError(
                f"{name}: a rank-4 lam must have shape [B, H, 1, 1], got lam.shape={shape}"
            )
        lam = lam[:, :, 0, 0]
    elif lam.ndim not in (0, 2):
        raise ValueError(
            f"{name}: lam must have shape [], [H], [B, H] or [B, H, 1, 1] with "
            f"{b=}, {h=}, got lam.shape={shape}"
        )
    try:
        return jnp.broadcast_to(lam.astype(jnp.float32), (b, h))
    except ValueError:
        raise ValueError(
            f"{name}: lam must have shape [], [H], [B, H] or [B, H, 1, 1] with "
            f"{b=}, {h=}, got lam.shape={shape}"
        ) from None


def l1_distance(
    x: jax.Array,
    y: jax.Array,
    *,
    impl: str = "auto",
    interpret: bool = False,
    block_sizes: BlockSizes | None = None,
) -> jax.Array:
    """Pairwise L1 distances ``out[b, h, i, j] = sum_d |x[b, h, i, d] - y[b, h, j, d]|``.

    Args:
      x: ``[B, H, N, D]`` floating (any float dtype; computed in float32).
      y: ``[B, H, M, D]`` floating.
      impl: ``"auto"`` (Pallas on GPU, else xla), ``"xla"`` or ``"pallas"``.
      interpret: run the Pallas kernels in the interpreter (CPU tests); only used by
        ``impl="pallas"``.
      block_sizes: `BlockSizes` for the Pallas path (powers of 2); ``None`` = defaults.

    Returns:
      ``[B, H, N, M]`` float32. Differentiable in x and y (sign-form custom VJP, sign(0) = 0).
    """
    _check_xy("l1_distance", x, y)
    cfg = _config("l1_distance", impl, interpret, block_sizes)
    b, h, n, _ = x.shape
    out = _l1(_flatten(x), _flatten(y), cfg)  # [BH, N, M]
    return out.reshape(b, h, n, y.shape[2])


def laplace_kernel(
    x: jax.Array,
    y: jax.Array,
    lam: jax.Array | float,
    *,
    impl: str = "auto",
    interpret: bool = False,
    block_sizes: BlockSizes | None = None,
) -> jax.Array:
    """Laplace kernel matrix ``K[b, h, i, j] = exp(-|x[b,h,i] - y[b,h,j]|_1 / lam[b, h])``.

    Args:
      x: ``[B, H, N, D]`` floating.
      y: ``[B, H, M, D]`` floating.
      lam: bandwidth > 0 (not checked: traced values can't be), shape ``[]`` (shared), ``[H]``
        (per head, broadcast over the batch), ``[B, H]`` (or broadcastable, e.g. ``[1, H]``) or
        ``[B, H, 1, 1]``.
      impl: as `l1_distance`. On the Pallas path the exponential is fused into the distance
        kernel.
      interpret: as `l1_distance`.
      block_sizes: as `l1_distance`.

    Returns:
      ``[B, H, N, M]`` float32; differentiable in x, y and lam.
    """
    _check_xy("laplace_kernel", x, y)
    cfg = _config("laplace_kernel", impl, interpret, block_sizes)
    b, h, n, _ = x.shape
    lam_bh = _broadcast_lam("laplace_kernel", lam, b, h)  # [B, H]
    out = _laplace(_flatten(x), _flatten(y), lam_bh.reshape(b * h), cfg)  # [BH, N, M]
    return out.reshape(b, h, n, y.shape[2])


def l1_distance_reference(x: jax.Array, y: jax.Array) -> jax.Array:
    """Naive oracle of `l1_distance`: materialises ``[B, H, N, M, D]``; float32 out.

    |t| is written t * sign(t) so that ``jax.grad`` takes the same subgradient sign(0) = 0 as
    the custom VJP at exact ties (frequent with bf16 inputs); ``jnp.abs`` would take +1.
    """
    _check_xy("l1_distance_reference", x, y)
    x = x.astype(jnp.float32)
    y = y.astype(jnp.float32)
    diff = x[:, :, :, None, :] - y[:, :, None, :, :]  # [B, H, N, M, D]
    return jnp.sum(diff * jnp.sign(diff), axis=-1)


def laplace_kernel_reference(x: jax.Array, y: jax.Array, lam: jax.Array | float) -> jax.Array:
    """Naive oracle of `laplace_kernel` (same lam shapes); float32 out."""
    _check_xy("laplace_kernel_reference", x, y)
    lam_bh = _broadcast_lam("laplace_kernel_reference", lam, x.shape[0], x.shape[1])
    return jnp.exp(-l1_distance_reference(x, y) / lam_bh[:, :, None, None])
