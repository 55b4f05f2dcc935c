"""The Nystrom core shared by ``nystromformer``, ``soft`` and ``laplacian`` (non-causal, O(T m)).

One core serves all three. Per head, with a kernel kappa and m landmarks
``Q~, K~`` (segment means of the masked sequence, or 2-D average pooling with
``grid=(h, w)``; see `linattn_jax.landmarks`)::

    C_q = kappa(Q, K~)  [Tq x m],   A = kappa(Q~, K~)  [m x m],   C_k = kappa(Q~, K)  [m x Tk]

and the ``Tq x Tk`` kernel matrix is estimated by ``C_q A^+ C_k``, never
materialised: the core forms ``C_k V`` first (``[m x Dv]``), then ``A^+ (C_k V)``,
then ``C_q (.)``. Cost O((Tq + Tk) m d + m^3).

The three mechanisms differ in kappa, the inverse and the normalisation; each has its own
module (`linattn_jax.nystromformer`, `linattn_jax.soft`, `linattn_jax.laplacian`).

Masks. ``mask [B, Tk]`` is the key-padding mask: masked keys take no part in
the key landmarks, ``C_k`` or any mean over keys. When ``Tq == Tk`` the mask is
taken as the padding mask of both sides (self-attention): masked tokens also
take no part in the query landmarks or the whitening statistics, so the
output on the valid queries equals the run on the unpadded sequence. When a
row has fewer valid tokens than landmark slots, the spare slots are invalid
and made inert: their columns of ``C_q`` and rows of ``C_k`` are zero, and their
block of ``A`` is a multiple of I (the largest valid diagonal entry), so every inverse
(Newton-Schulz, the Nystromformer iteration, the exact solve), all of which keep the
block structure, acts on the valid block alone. A slot is valid when both its query and
its key landmark are (the two sides can differ in cross-attention). A row with
no valid key returns zeros.

Inverse (config ``inverse``): ``"iterative"`` (default; the mechanism's
iteration above) or ``"exact"``: ``(A + eps I)^-1`` by an LU solve (eps = 0 for
nystromformer), a true inverse with no singular-value cutoff (``jnp.linalg.pinv`` drops
singular values below ~1e-4 of the largest), for tests and ablations. soft and laplacian
default to 20 and 30 Newton-Schulz steps: on the q, k, v of the real models at init (ListOps
mini, ViT mini and DeiT-tiny) tripling them changes the output by < 0.4% (laplacian 1.1e-4,
soft 3.8e-3 at most; ``python -m train.bench_activations --sections laplacian``;
``kernels.bench`` reports the residual against the iterations on synthetic landmark
matrices).

Each mechanism has a ``reference`` (the same landmarks and inverse with the
``Tq x Tk`` matrix ``C_q A^+ C_k`` materialised and the normalisation applied to
it; the oracle the linear path is tested against) and a ``*_weights``
function giving the effective weights ``[B, H, Tq, Tk]`` (``out = weights @ v``).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

import kernels
from linattn_jax import _checks, _seq, core
from linattn_jax import landmarks as lm

_f32 = jnp.float32

#: Added to the per-coordinate variance in the injective whitening.
WHITEN_EPS = 1e-5

_INVERSES = ("iterative", "exact")
_IMPLS = ("auto", "xla", "pallas")

# Kernels kappa (one per mechanism, in its module): each takes x [B, H, N, D], y [B, H, M, D]
# (float32) and a column mask [B, M] and returns [B, H, N, M] float32 with the masked columns
# zero. `axis`: the columns are this device's part of a sequence split over that mesh axis
# (`_seq`).


def sq_dist(x, y, precision=None):
    """``|x_n - y_m|_2^2`` as ``[B, H, N, M]`` from x ``[B, H, N, D]``, y ``[B, H, M, D]``,
    expanded (``|x|^2 + |y|^2 - 2 x.y``, one matmul) and clamped at 0, where rounding can
    make it slightly negative. `precision`: the matmul's (`jax.lax.Precision`)."""
    cross = jnp.einsum("bhnd,bhmd->bhnm", x, y, precision=precision)
    sq = jnp.sum(x * x, axis=-1)[..., :, None] + jnp.sum(y * y, axis=-1)[..., None, :]
    return jnp.maximum(sq - 2.0 * cross, 0.0)


# --------------------------------------------------------------------------- inverses


def _eye_like(a):
    """The identity ``[1, ..., 1, m, m]`` of the rank of ``a [..., m, m]`` (no rank promotion)."""
    m = a.shape[-1]
    return jnp.eye(m, dtype=_f32).reshape((1,) * (a.ndim - 2) + (m, m))


def iterative_pinv(a, iters: int):
    """The Nystromformer iterative pseudo-inverse of ``a [..., m, m]`` (float32).

    ``Z_0 = A^T / (max_j sum_i |A_ij| * max_i sum_j |A_ij|)`` (per matrix), then
    ``iters`` times ``Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4``.
    """
    a = a.astype(_f32)
    eye = _eye_like(a)
    abs_a = jnp.abs(a)
    col = jnp.max(jnp.sum(abs_a, axis=-2), axis=-1)[..., None, None]
    row = jnp.max(jnp.sum(abs_a, axis=-1), axis=-1)[..., None, None]
    z0 = jnp.swapaxes(a, -1, -2) / jnp.maximum(col * row, 1e-30)

    def body(_, z):
        az = a @ z
        return 0.25 * z @ (13.0 * eye - az @ (15.0 * eye - az @ (7.0 * eye - az)))

    return lax.fori_loop(0, iters, body, z0)


def inverter(inverse: str, family: str, ns_iters: int, eps: float, impl: str, interpret: bool):
    """``a [.., C, C] -> inverse``: the landmark-matrix inverse `inverse` names (``"exact"``:
    an LU solve of ``a + eps I``; otherwise `ns_iters` Newton-Schulz iterations, `impl`
    ``"auto"``, ``"xla"`` or ``"pallas"``, `interpret` for the Pallas kernel on CPU); `family`
    names the mechanism in errors."""
    if inverse == "exact":

        def exact(a):
            # A true inverse (LU solve against I), no singular-value cutoff: pinv's default
            # cutoff (~1e-4 of the largest) dropped the very directions Newton-Schulz inverts.
            p = a.astype(_f32) + eps * _eye_like(a)
            return jnp.linalg.solve(p, jnp.broadcast_to(_eye_like(a), p.shape))

        return exact
    if family == "nystromformer":
        return lambda a: iterative_pinv(a, ns_iters)

    def newton_schulz(a):
        v = kernels.newton_schulz_inverse(
            a, iters=ns_iters, eps=eps, impl=impl, interpret=interpret
        )
        return v.astype(_f32)

    return newton_schulz


# --------------------------------------------------------------------------- the shared core


def _landmarks(x, m, mask, grid, n_slots, axis=None):
    """Segment-mean landmarks ``[B, H, n_slots, D]`` and validity ``[B, n_slots]`` (slots past
    the sequence's own count zero-padded and invalid), without a one-hot assignment matrix
    (`linattn_jax.landmarks.landmarks`; `landmarks.sharded_landmarks` over `axis`)."""
    if axis is None:
        x_lm, valid = lm.landmarks(x, m, mask=mask, grid=grid)
    else:
        x_lm, valid = lm.sharded_landmarks(x, m, axis, mask=mask, grid=grid)
    pad = n_slots - x_lm.shape[1]
    if pad:
        x_lm = jnp.pad(x_lm, ((0, 0), (0, pad), (0, 0), (0, 0)))
        valid = jnp.pad(valid, ((0, 0), (0, pad)))
    return _heads_first(x_lm), valid


def _heads_first(x):
    return jnp.swapaxes(x, 1, 2)  # [B, T, H, D] <-> [B, H, T, D]


def _whiten(c, qmask, axis=None, center=True):
    """Diagonal whitening of ``c [B, H, Tq, L]`` over the unmasked queries (of the whole
    sequence: with `axis`, the sums run over its devices too): ``(c - E c) diag(var c +
    eps)^-1/2`` per landmark coordinate (``center=False``: ``c diag(E c^2 + eps)^-1/2``, the
    ``normalize="uncentered"`` ablation)."""
    w = qmask[:, None, :, None].astype(_f32)
    n = jnp.maximum(_seq.psum(jnp.sum(w, axis=2, keepdims=True), axis), 1.0)
    if center:
        c = c - _seq.psum(jnp.sum(c * w, axis=2, keepdims=True), axis) / n
    second = _seq.psum(jnp.sum(jnp.square(c) * w, axis=2, keepdims=True), axis) / n
    return c * lax.rsqrt(second + WHITEN_EPS)


def _local_taps(window: int, grid):
    """Offsets of the local branch: ``[(dt,)]`` along the sequence or ``[(dr, dc)]`` on the grid."""
    r = window // 2
    if grid is None:
        return [(o,) for o in range(-r, r + 1)]
    return [(a, b) for a in range(-r, r + 1) for b in range(-r, r + 1)]


def _local_matrix(local_w, tk, grid):
    """The local branch as a banded ``[H, Tk, Tk]`` matrix (naive; for the reference path)."""
    window = local_w.shape[0]
    r = window // 2
    i = jnp.arange(tk)[:, None]
    j = jnp.arange(tk)[None, :]
    if grid is None:
        near = jnp.abs(j - i) <= r
        taps = local_w[jnp.clip(j - i + r, 0, window - 1)]  # [Tk, Tk, H]
    else:
        gh, gw = grid
        start = tk - gh * gw  # tokens before the image take no part
        pi, pj = i - start, j - start
        dr, dc = pj // gw - pi // gw, pj % gw - pi % gw
        near = (pi >= 0) & (pj >= 0) & (jnp.abs(dr) <= r) & (jnp.abs(dc) <= r)
        taps = local_w[jnp.clip(dr + r, 0, window - 1), jnp.clip(dc + r, 0, window - 1)]
    return jnp.moveaxis(jnp.where(near[..., None], taps, 0.0), -1, 0)


def _local_branch(local_w, vh, grid, axis=None):
    """Depthwise convolution of ``vh [B, H, Tk, Dv]`` (masked keys already zero), one filter
    per head: ``local_w [w, H]`` along the sequence or ``[w, w, H]`` over the grid. With
    `axis` (1-D only), the rows past this device's ends come from its neighbours."""
    r = local_w.shape[0] // 2
    b, h, t, dv = vh.shape
    out = jnp.zeros_like(vh)
    if grid is None:
        vp = _seq.halo(vh, r, 2, axis)
        for (o,) in _local_taps(local_w.shape[0], None):
            out = out + local_w[o + r][None, :, None, None] * vp[:, :, o + r : o + r + t]
        return out
    gh, gw = grid
    start = t - gh * gw
    img = vh[:, :, start:].reshape(b, h, gh, gw, dv)
    ip = jnp.pad(img, ((0, 0), (0, 0), (r, r), (r, r), (0, 0)))
    acc = jnp.zeros_like(img)
    for a, c in _local_taps(local_w.shape[0], grid):
        tap = local_w[a + r, c + r][None, :, None, None, None]
        acc = acc + tap * ip[:, :, a + r : a + r + gh, c + r : c + r + gw]
    return out.at[:, :, start:].set(acc.reshape(b, h, gh * gw, dv))


def nystrom(
    qx, kx, v, mask, kappa, invert, *, num_landmarks, grid, normalize, output,
    shared_landmarks=False, local_w=None, axis=None,
):  # fmt: skip
    """The shared Nystrom core.

    Args:
      qx: ``[B, Tq, H, D]`` float32 query-side inputs of the kernel.
      kx: ``[B, Tk, H, D]`` float32 key-side inputs of the kernel.
      v: ``[B, Tk, H, Dv]`` values.
      mask: optional ``[B, Tk]`` key-padding mask (also the query mask when Tq == Tk).
      kappa: ``kappa(x, y, col_valid) -> [B, H, N, M]``.
      invert: ``[B, H, L, L] -> [B, H, L, L]`` (pseudo-)inverse.
      num_landmarks: m, the requested number of landmarks (`landmarks.num_landmarks`).
      grid: optional ``(h, w)``: the last ``h * w`` tokens are an image (2-D landmarks and
        local branch).
      normalize: ``"none"``, ``"row"`` or ``"injective"``.
      output: ``"linear"`` (the O(T m) path), ``"reference"`` (materialised
        ``Tq x Tk``) or ``"weights"`` (the effective weights ``[B, H, Tq, Tk]``).
      shared_landmarks: one landmark set, the key landmarks, on both sides:
        ``A = kappa(K~, K~)``, ``C_k = kappa(K~, K)`` (symmetric A); else
        ``A = kappa(Q~, K~)``, ``C_k = kappa(Q~, K)``.
      local_w: optional local-branch filters ``[w, H]`` / ``[w, w, H]`` (self-attention only).
      axis: optional mesh axis (inside ``shard_map``, ``output="linear"`` only) over which q,
        k, v and mask are split along T, each device holding a contiguous part in axis
        order: the landmarks, the sums over keys (``C_k V``, ``C_k 1``, the key softmax of
        nystromformer) and the whitening statistics are reduced over its devices, the local
        branch (1-D) exchanges its edge rows; nothing T-long crosses devices.

    Returns:
      ``[B, Tq, H, Dv]`` float32, or the weights for ``output="weights"``.
    """
    b, tq, _, _ = qx.shape
    tk = kx.shape[1]
    kmask = core.key_mask(mask, tk, b)
    qmask = mask if (mask is not None and tq == tk) else jnp.ones((b, tq), bool)
    shards = 1 if axis is None else lax.axis_size(axis)
    n_slots = lm.num_landmarks(tk * shards, num_landmarks, grid)
    if not shared_landmarks:
        n_slots = max(n_slots, lm.num_landmarks(tq * shards, num_landmarks, grid))
    k_lm, valid = _landmarks(kx, num_landmarks, mask, grid, n_slots, axis)  # [B, H, L, D]
    if shared_landmarks:
        left = k_lm
    else:
        q_only = mask if (mask is not None and tq == tk) else None
        left, valid_q = _landmarks(qx, num_landmarks, q_only, grid, n_slots, axis)
        valid = valid & valid_q  # a slot is valid when both its landmarks are
    qh, kh = _heads_first(qx), _heads_first(kx)

    c_q = kappa(qh, k_lm, valid)  # [B, H, Tq, L]
    row_valid = valid[:, None, :, None]
    a = kappa(left, k_lm, valid) * row_valid  # [B, H, L, L]
    # An invalid slot gets the largest valid diagonal entry on the diagonal (1 when none is
    # valid): its block of A is then a multiple of I, so every inverse stays finite (the exact
    # solve with eps = 0 included) and, since its C_q column and C_k row are zero, inert. The
    # entries are >= 0, so no row or column sum grows past its maximum and the scales of the
    # iterations do not change.
    eye = jnp.eye(n_slots, dtype=bool)[None, None]
    if shared_landmarks:
        # The diagonal is kappa(x, x), a constant; the Laplace kernel has a kink there, and
        # under jit XLA may round the two copies of a landmark apart, so the subgradient
        # (+-1 per coordinate instead of 0) would depend on fusion. Its true gradient is 0.
        a = jnp.where(eye, lax.stop_gradient(a), a)
    diag = jnp.max(jnp.where(eye & row_valid, a, 0.0), axis=(-2, -1), keepdims=True)
    a = jnp.where(eye & ~row_valid, jnp.where(diag > 0, diag, 1.0), a)
    c_k = kappa(left, kh, kmask, axis) * row_valid  # [B, H, L, Tk]
    a_inv = invert(a)

    if normalize in ("injective", "uncentered"):
        feats = _whiten(c_q, qmask, axis, center=normalize == "injective")
    else:
        feats = c_q
    vh = _heads_first(v.astype(_f32)) * kmask[:, None, :, None]  # [B, H, Tk, Dv]
    local = local_w is not None and tq == tk

    if output != "linear":
        if axis is not None:
            raise ValueError(f"output={output!r} materialises Tq x Tk: not over a mesh axis")
        w = feats @ (a_inv @ c_k)  # [B, H, Tq, Tk]: the materialised estimate
        kcol = kmask[:, None, None, :]
        if normalize == "row":
            w = w / core.guard_denominator(jnp.sum(w, axis=-1, keepdims=True))
        if local:
            w = w + _local_matrix(local_w, tk, grid)[None]
        w = jnp.where(kcol, w, 0.0)
        if output == "weights":
            return w
        return _heads_first(w @ vh)

    out = feats @ (a_inv @ _seq.psum(c_k @ vh, axis))  # C_k V first: [B, H, L, Dv]
    if normalize == "row":
        r = _seq.psum(jnp.sum(c_k, axis=-1), axis)  # [B, H, L]: C_k 1
        den = jnp.einsum("bhtl,bhl->bht", feats, jnp.einsum("bhlm,bhm->bhl", a_inv, r))
        out = out / core.guard_denominator(den)[..., None]
    if local:
        out = out + _local_branch(local_w, vh, grid, axis)
    return _heads_first(out)


# --------------------------------------------------------------------------- validation


def check_nystrom_config(name, *, num_landmarks, ns_iters, grid, inverse, eps=0.0, normalize=None):
    """Raises ValueError naming `name` and the argument unless the Nystrom config is valid:
    `num_landmarks`, `ns_iters` >= 1, `inverse` a known inverse, `grid` None or ``(h, w)``
    ints >= 1, `eps` >= 0, `normalize` ``(value, choices)`` with value among the choices."""
    _checks.check_positive(name, num_landmarks=num_landmarks, ns_iters=ns_iters)
    _checks.check_choice(name, "inverse", inverse, _INVERSES)
    if normalize is not None:
        _checks.check_choice(name, "normalize", normalize[0], normalize[1])
    if grid is not None:
        ok = isinstance(grid, tuple) and len(grid) == 2
        ok = ok and all(isinstance(g, int) and not isinstance(g, bool) and g >= 1 for g in grid)
        if not ok:
            raise ValueError(
                f"{name}: grid must be None or a tuple (h, w) of ints >= 1, got {grid!r}"
            )
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps >= 0:
        raise ValueError(f"{name}: eps must be a float >= 0, got {eps!r}")


def check_grid_fits(name, grid, q, k):
    """Raises ValueError unless a landmark `grid` ``(h, w)`` has ``h * w`` at most the length
    of `q` and of `k`."""
    if grid is not None:
        h, w = grid
        for arg, x in (("q", q), ("k", k)):
            if h * w > x.shape[1]:
                raise ValueError(
                    f"{name}: grid={grid} needs h * w = {h * w} <= the length of {arg}, got "
                    f"{arg} shape {x.shape}"
                )


def check_impl(name, impl):
    """Raises ValueError unless `impl` is a known implementation (``"auto"``, ``"xla"``,
    ``"pallas"``)."""
    _checks.check_choice(name, "impl", impl, _IMPLS)


__all__ = ["WHITEN_EPS", "iterative_pinv"]
