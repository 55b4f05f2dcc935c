"""The Nystrom family: ``nystromformer``, ``soft`` and ``laplacian`` (non-causal, O(T m)).

One core serves all three. Per head, with a kernel kappa and m landmarks
``Q~, K~`` (segment means of the masked sequence, or 2-D average pooling with
``grid=(h, w)``; see `linattn_jax.landmarks`)::

    C_q = kappa(Q, K~)  [Tq x m],   A = kappa(Q~, K~)  [m x m],   C_k = kappa(Q~, K)  [m x Tk]

and the ``Tq x Tk`` kernel matrix is estimated by ``C_q A^+ C_k``, never
materialised: the core forms ``C_k V`` first (``[m x Dv]``), then ``A^+ (C_k V)``,
then ``C_q (.)``. Cost O((Tq + Tk) m d + m^3).

* ``nystromformer`` (Xiong et al. 2021): kappa is the row softmax of scaled dot
  products, ``softmax(Q K~^T / sqrt d)``, ``softmax(Q~ K~^T / sqrt d)``,
  ``softmax(Q~ K^T / sqrt d)`` (masked keys excluded from the last), and ``A^+``
  is the paper's iterative pseudo-inverse
  ``Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4`` from
  ``Z_0 = A^T / (max_j sum_i |A_ij| * max_i sum_j |A_ij|)`` (``ns_iters``
  iterations, default 6). The scale of ``Z_0`` is taken per batch row and head
  (the paper's code takes it over the whole batch), so rows of a batch stay
  independent. Output ``C_q Z (C_k V)``.
* ``soft`` (Lu et al. 2021): Gaussian kernel ``exp(-|q^ - k^|^2 / 2)`` with
  ``x^ = x d^(-1/4)``. As in SOFT the key side is tied to the queries
  (k := q): with ``tie_qk="auto"`` (the default) the kernel is evaluated on q for
  both sides whenever ``Tq == Tk`` (taken as self-attention, like the mask rule
  below; `k` is then used only for validation and gets a zero gradient; v is
  still the values) and on k when ``Tq != Tk`` (cross-attention: nothing to tie);
  ``tie_qk=True`` always ties (needs ``Tq == Tk``), ``tie_qk=False`` never does.
  ``A^+`` by Newton-Schulz (`kernels.newton_schulz_inverse`, ``P = A + eps I``).
  Output ``C_q A^+ (C_k V)`` with no normalisation, as in SOFT
  (``normalize="none"``, the default), or divided by the same estimate of the
  row sums (``normalize="row"``).
* ``laplacian`` (LaplacianFormer, seed 003): Laplace kernel ``exp(-|q - k|_1 / lambda)``
  on the raw q, k, lambda > 0 per head: learnable (``params["log_lam"] [H]``) when the
  config ``lam`` is None (the default), or the fixed value ``lam`` (then there is no param;
  the paper's models use lam = 4). The paper does not say how lambda scales with d; we
  init it at d / 2 (`laplacian_lam_init`): on the q, k of the real LRA encoder and ViT at
  init the median L1 distance is 1.11 d - 1.15 d, so the median kernel entry is 0.10 - 0.11
  (median C_q entry 0.12 - 0.16), where sqrt(d) gives 1.2e-4 at d = 64 (measured by
  ``python -m train.bench_activations --sections laplacian``; docs/activations.md, like
  every real-activation number below). Kernel matrices from
  `kernels.laplace_kernel` (Pallas on GPU; ``impl``/``interpret`` are passed through),
  ``A^+`` by Newton-Schulz.

  Injective feature map (the paper; default ``normalize="injective"``):
  ``c_i = kappa(q_i, K~)`` is whitened per landmark coordinate over the (unmasked) queries
  of the same sequence (the diagonal approximation of the paper's whitening matrix;
  statistics per sequence, never across the batch), ``c^_i = (c_i - mean_i c) /
  sqrt(var_i c + 1e-5)``, and ``out_i = c^_i A^+ (C_k V)``: no row normalisation, no 1/T.
  With m = T, an exact inverse and eps = 0 this is ``whiten_columns(K) V`` for the full
  Laplace kernel matrix K. Its scale is not normalised and is large (numbers on the real
  models at init in docs/activations.md); the block's output projection and the next
  LayerNorm absorb it.
  The centring makes every landmark column sum to zero over the queries, so the global
  output sums to zero over the sequence, ``sum_i out_i = 0`` exactly: a model that
  mean-pools its tokens sees the global branch only through the nonlinearities after it.
  The seed ("normalises the query-key similarity vectors with a diagonally approximated
  whitening matrix") does not say whether it centres. ``normalize="uncentered"`` divides
  the uncentred c by each column's root mean square instead (dividing it by the std makes
  the common part of the output 9 - 70x the query-dependent part on the real models); on
  mini Pathfinder, whose encoder mean-pools, the two were level over three seeds (README,
  laplacian section), so the default stays the centred form of our SPEC. Other ablations:
  ``normalize="row"`` ``(c_i A^+ C_k V) / (c_i A^+ C_k 1)`` (guarded,
  `core.guard_denominator`) and ``normalize="none"``, plain Nystrom ``c_i A^+ C_k V``.

  Landmark matrix (our choice, config ``shared_landmarks``, default True): one landmark set,
  the key landmarks K~, on both sides, ``A = kappa(K~, K~)``, ``C_k = kappa(K~, K)``. A is
  then symmetric positive definite (the Laplace kernel is positive definite), so
  ``A + eps I`` has sigma_min >= eps and Newton-Schulz converges. Nystromformer's separate
  query landmarks (``shared_landmarks=False``, ``A = kappa(Q~, K~)``) give a non-symmetric
  A whose sigma_min falls to 4.0e-8 - 4.6e-6 against sigma_max 3.7 - 21 on the real
  activations at init (ListOps mini, ViT mini, DeiT-tiny; lambda = d / 2): there the
  Newton-Schulz residual ``max |P V - I|`` is 0.38 - 0.65 after 20 steps and 0.026 - 0.29
  after 30, float32 diverges by 60 steps on DeiT-tiny (1e3), and the output is 1.5 - 8.6x the
  scale of the shared form's (std(out) / std(v) 69 vs 8, 135 vs 36, 926 vs 633). Shared
  landmarks: sigma_min(A) >= 0.03, residual <= 4.6e-4 after 20 steps and <= 2.9e-5 after 30
  (the default ``ns_iters``), and tripling the steps changes the output by <= 1.1e-4. Both
  forms estimate the same K: ``C_q A^+ C_k`` is exact when the landmarks are all the keys.

  Local branch (the paper's depthwise convolution on V, added to the global output):
  config ``local_window`` w (odd; 0 = off; default 3), params ``"local"`` ``[w, H]`` (along
  the sequence, zero padded) or ``[w, w, H]`` (over the ``grid`` image, whose leading tokens,
  e.g. CLS, get no local term). One filter per head, shared by the head's Dv channels (the
  paper's convolution has one per channel; init knows only head_dim, and v's width may
  differ); init uniform in ``+-1/sqrt(w)`` (``+-1/w`` on the grid), PyTorch's default.
  Masked keys are zeroed before the convolution, so they contribute nothing. Only for
  self-attention (Tq == Tk); in cross-attention there is no token alignment and it is off.

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

import math

import jax
import jax.numpy as jnp
from jax import lax

import kernels
from linattn_jax import _checks, _seq, core
from linattn_jax import landmarks as lm
from linattn_jax.registry import Mechanism, register

_f32 = jnp.float32

#: Added to the per-coordinate variance in the injective whitening.
WHITEN_EPS = 1e-5

_INVERSES = ("iterative", "exact")

#: Default Newton-Schulz iterations (see the module docstring for the measurements).
SOFT_NS_ITERS = 20
LAP_NS_ITERS = 30
_IMPLS = ("auto", "xla", "pallas")


# --------------------------------------------------------------------------- kernels kappa
# Each kappa takes x [B, H, N, D], y [B, H, M, D] (float32) and a column mask
# [B, M] and returns [B, H, N, M] float32 with the masked columns zero. `axis`: the
# columns are this device's part of a sequence split over that mesh axis (`_seq`).


def _softmax_kappa(x, y, col_valid, axis=None):
    """Row softmax of ``x y^T`` over the unmasked columns (x, y already scaled by d^-1/4)."""
    logits = jnp.einsum("bhnd,bhmd->bhnm", x, y)
    valid = col_valid[:, None, None, :]
    mx = _seq.masked_max(logits, valid, -1, axis)
    e = jnp.where(valid, jnp.exp(jnp.where(valid, logits - mx, 0.0)), 0.0)
    den = _seq.psum(jnp.sum(e, axis=-1, keepdims=True), axis)
    return e / jnp.where(den > 0, den, 1.0)


def _gaussian_kappa(x, y, col_valid, axis=None):
    """``exp(-|x - y|^2 / 2)`` (x, y already scaled by d^-1/4)."""
    sq = (
        jnp.sum(x * x, axis=-1)[..., :, None]
        + jnp.sum(y * y, axis=-1)[..., None, :]
        - 2.0 * jnp.einsum("bhnd,bhmd->bhnm", x, y)
    )
    del axis  # entrywise
    # Rounding can make the expanded squared distance slightly negative.
    return jnp.exp(-0.5 * jnp.maximum(sq, 0.0)) * col_valid[:, None, None, :]


def _laplace_kappa(lam, impl, interpret):
    """``exp(-|x - y|_1 / lam_h)`` with lam ``[H]`` (`kernels.laplace_kernel`, exp fused)."""

    def kappa(x, y, col_valid, axis=None):
        del axis  # entrywise
        k = kernels.laplace_kernel(x, y, lam, impl=impl, interpret=interpret)  # lam: [H]
        return k * col_valid[:, None, None, :]

    return kappa


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


def _inverter(inverse: str, family: str, ns_iters: int, eps: float, impl: str, interpret: bool):
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


def _nystrom(
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


def _check_config(name, *, num_landmarks, ns_iters, grid, inverse, eps=0.0, normalize=None):
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


def _check_grid_fits(name, grid, q, k):
    if grid is not None:
        h, w = grid
        for arg, x in (("q", q), ("k", k)):
            if h * w > x.shape[1]:
                raise ValueError(
                    f"{name}: grid={grid} needs h * w = {h * w} <= the length of {arg}, got "
                    f"{arg} shape {x.shape}"
                )


def _check_impl(name, impl):
    _checks.check_choice(name, "impl", impl, _IMPLS)


# --------------------------------------------------------------------------- nystromformer

_NF = "nystromformer"


def _nystromformer(
    q, k, v, mask, causal, num_landmarks, ns_iters, grid, inverse, output, axis=None
):  # fmt: skip
    _checks.check_inputs(_NF, q, k, v, mask, causal=causal)
    _checks.check_causal_supported(_NF, causal)
    _check_config(_NF, num_landmarks=num_landmarks, ns_iters=ns_iters, grid=grid, inverse=inverse)
    _check_grid_fits(_NF, grid, q, k)
    invert = _inverter(inverse, _NF, ns_iters, 0.0, "xla", False)
    return _nystrom(
        core.scale_inputs(q),
        core.scale_inputs(k),
        v,
        mask,
        _softmax_kappa,
        invert,
        num_landmarks=num_landmarks,
        grid=grid,
        normalize="none",
        output=output,
        axis=axis,
    )


def nystromformer_init(rng, *, num_heads: int, head_dim: int):
    """Nystromformer has no params."""
    del rng, num_heads, head_dim
    return {}


def nystromformer_attention(
    q,
    k,
    v,
    params,
    rng=None,
    *,
    mask=None,
    causal=False,
    deterministic=False,
    num_landmarks=64,
    ns_iters=6,
    grid=None,
    inverse="iterative",
):
    """Nystromformer attention ``[B, Tq, H, Dv]`` in q's dtype; see the module docstring.

    Args:
      num_landmarks: m, the number of landmarks (segment means; with ``grid``
        an ``isqrt(m) x (m // isqrt(m))`` pooling grid).
      ns_iters: iterations of the iterative pseudo-inverse (paper: 6).
      grid: optional ``(h, w)``: the last ``h * w`` tokens are an image.
      inverse: ``"iterative"`` or ``"exact"`` (``A^-1`` by an LU solve).
    """
    del params, rng, deterministic
    out = _nystromformer(q, k, v, mask, causal, num_landmarks, ns_iters, grid, inverse, "linear")
    return out.astype(q.dtype)


def nystromformer_reference(
    q,
    k,
    v,
    params,
    rng=None,
    *,
    mask=None,
    causal=False,
    deterministic=False,
    num_landmarks=64,
    ns_iters=6,
    grid=None,
    inverse="iterative",
):
    """`nystromformer_attention` with ``C_q Z C_k`` materialised (``[B, H, Tq, Tk]``)."""
    del params, rng, deterministic
    out = _nystromformer(q, k, v, mask, causal, num_landmarks, ns_iters, grid, inverse, "reference")
    return out.astype(q.dtype)


def nystromformer_weights(
    q, k, params=None, *, mask=None, num_landmarks=64, ns_iters=6, grid=None, inverse="iterative"
):
    """Effective weights ``C_q Z C_k`` as ``[B, H, Tq, Tk]`` float32 (``out = weights @ v``)."""
    del params
    v = jnp.zeros(k.shape[:3] + (1,), _f32)
    return _nystromformer(q, k, v, mask, False, num_landmarks, ns_iters, grid, inverse, "weights")


# --------------------------------------------------------------------------- soft

_SOFT = "soft"
_SOFT_NORMALIZE = ("none", "row")


def _soft(
    q, k, v, mask, causal, num_landmarks, ns_iters, eps, grid, inverse, normalize, tie_qk,
    impl, interpret, output, axis=None,
):  # fmt: skip
    _checks.check_inputs(_SOFT, q, k, v, mask, causal=causal)
    _checks.check_causal_supported(_SOFT, causal)
    _check_config(
        _SOFT,
        num_landmarks=num_landmarks,
        ns_iters=ns_iters,
        grid=grid,
        inverse=inverse,
        eps=eps,
        normalize=(normalize, _SOFT_NORMALIZE),
    )
    _check_impl(_SOFT, impl)
    if not (tie_qk is True or tie_qk is False or tie_qk == "auto"):
        raise ValueError(f"{_SOFT}: tie_qk must be True, False or 'auto', got {tie_qk!r}")
    if tie_qk is True and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"{_SOFT}: tie_qk=True evaluates the key side of the kernel on q (as SOFT), which "
            f"needs Tq == Tk; got q {q.shape}, k {k.shape}. Pass tie_qk='auto' or False for "
            "cross-attention."
        )
    tie = tie_qk is True or (tie_qk == "auto" and q.shape[1] == k.shape[1])
    _check_grid_fits(_SOFT, grid, q, k)
    qx = core.scale_inputs(q)
    kx = qx if tie else core.scale_inputs(k)
    invert = _inverter(inverse, _SOFT, ns_iters, eps, impl, interpret)
    return _nystrom(
        qx,
        kx,
        v,
        mask,
        _gaussian_kappa,
        invert,
        num_landmarks=num_landmarks,
        grid=grid,
        normalize=normalize,
        output=output,
        axis=axis,
    )


def soft_init(rng, *, num_heads: int, head_dim: int):
    """SOFT has no params."""
    del rng, num_heads, head_dim
    return {}


def soft_attention(
    q,
    k,
    v,
    params,
    rng=None,
    *,
    mask=None,
    causal=False,
    deterministic=False,
    num_landmarks=64,
    ns_iters=SOFT_NS_ITERS,
    eps=0.01,
    grid=None,
    inverse="iterative",
    normalize="none",
    tie_qk="auto",
    impl="auto",
    interpret=False,
):
    """SOFT attention ``[B, Tq, H, Dv]`` in q's dtype; see the module docstring.

    Args:
      num_landmarks: m, the number of landmarks.
      ns_iters: Newton-Schulz iterations (default 20).
      eps: the Newton-Schulz regulariser, ``P = A + eps I``.
      grid: optional ``(h, w)``: the last ``h * w`` tokens are an image.
      inverse: ``"iterative"`` (Newton-Schulz) or ``"exact"`` (``(A + eps I)^-1``, LU).
      normalize: ``"none"`` (SOFT: ``C_q A^+ C_k V``) or ``"row"`` (divided by
        ``C_q A^+ C_k 1``, guarded).
      tie_qk: ``"auto"`` (default): evaluate the key side of the kernel on q (SOFT)
        when ``Tq == Tk``, on k otherwise; ``True``: always on q (needs Tq == Tk);
        ``False``: always on k.
      impl, interpret: passed to `kernels.newton_schulz_inverse`.
    """
    del params, rng, deterministic
    out = _soft(
        q, k, v, mask, causal, num_landmarks, ns_iters, eps, grid, inverse, normalize, tie_qk,
        impl, interpret, "linear",
    )  # fmt: skip
    return out.astype(q.dtype)


def soft_reference(
    q,
    k,
    v,
    params,
    rng=None,
    *,
    mask=None,
    causal=False,
    deterministic=False,
    num_landmarks=64,
    ns_iters=SOFT_NS_ITERS,
    eps=0.01,
    grid=None,
    inverse="iterative",
    normalize="none",
    tie_qk="auto",
    impl="auto",
    interpret=False,
):
    """`soft_attention` with ``C_q A^+ C_k`` materialised (``[B, H, Tq, Tk]``)."""
    del params, rng, deterministic
    out = _soft(
        q, k, v, mask, causal, num_landmarks, ns_iters, eps, grid, inverse, normalize, tie_qk,
        impl, interpret, "reference",
    )  # fmt: skip
    return out.astype(q.dtype)


def soft_weights(
    q,
    k,
    params=None,
    *,
    mask=None,
    num_landmarks=64,
    ns_iters=SOFT_NS_ITERS,
    eps=0.01,
    grid=None,
    inverse="iterative",
    normalize="none",
    tie_qk="auto",
    impl="auto",
    interpret=False,
):
    """Effective SOFT weights ``[B, H, Tq, Tk]`` float32 (``out = weights @ v``)."""
    del params
    v = jnp.zeros(k.shape[:3] + (1,), _f32)
    return _soft(
        q, k, v, mask, False, num_landmarks, ns_iters, eps, grid, inverse, normalize, tie_qk,
        impl, interpret, "weights",
    )  # fmt: skip


# --------------------------------------------------------------------------- laplacian

_LAP = "laplacian"
_LAP_NORMALIZE = ("injective", "uncentered", "row", "none")


def laplacian_lam_init(head_dim: int) -> float:
    """The initial lambda, ``d / 2``.

    The paper gives lambda = 4 for its models and says nothing about how lambda scales with
    d. On the q, k the real models produce at init (the LRA encoder on ListOps mini, d = 16;
    the ViT mini preset, d = 16, and DeiT-tiny, d = 64; measured by ``python -m
    train.bench_activations --sections laplacian``, docs/activations.md), the median L1
    distance is 1.11 d - 1.15 d (2 d / sqrt(pi) = 1.13 d for unit Gaussians), so lambda = d / 2
    puts the median kernel entry at 0.10 - 0.11 (10% - 90% quantiles 0.055 - 0.18), where
    lambda = sqrt(d) gives 1.2e-4 at d = 64 and lambda = 4 gives 1.5e-8.
    """
    return head_dim / 2.0


def laplacian_init(rng, *, num_heads: int, head_dim: int, lam=None, local_window=3, grid=None):
    """``{"log_lam": [H]}`` (when `lam` is None) and ``{"local": [w, H]}`` (``[w, w, H]``
    with `grid`; when ``local_window = w > 0``).

    ``log_lam`` starts at ``log(d / 2)`` (`laplacian_lam_init`). The local filters start
    like PyTorch's default ``Conv`` init (the paper's code is PyTorch): uniform in
    ``+-1 / sqrt(fan_in)``, fan_in = w (w * w on the grid).
    """
    _check_lam(lam)
    _check_local_window(local_window)
    params = {}
    if lam is None:
        params["log_lam"] = jnp.full((num_heads,), math.log(laplacian_lam_init(head_dim)), _f32)
    if local_window:
        shape = _local_shape(local_window, grid, num_heads)
        bound = 1.0 / math.sqrt(math.prod(shape[:-1]))
        params["local"] = jax.random.uniform(rng, shape, _f32, -bound, bound)
    return params


def _local_shape(local_window, grid, num_heads):
    return (local_window,) * (1 if grid is None else 2) + (num_heads,)


def _check_lam(lam):
    if lam is not None and (
        isinstance(lam, bool) or not isinstance(lam, int | float) or not lam > 0
    ):
        raise ValueError(f"{_LAP}: lam must be None (learnable) or a float > 0, got {lam!r}")


def _check_local_window(local_window):
    ok = isinstance(local_window, int) and not isinstance(local_window, bool)
    if not (ok and (local_window == 0 or (local_window > 0 and local_window % 2 == 1))):
        raise ValueError(
            f"{_LAP}: local_window must be 0 (no local branch) or an odd int >= 1, got "
            f"{local_window!r}"
        )


def _laplacian(
    q, k, v, params, mask, causal, num_landmarks, ns_iters, eps, lam, grid, inverse, normalize,
    local_window, shared_landmarks, impl, interpret, output, axis=None,
):  # fmt: skip
    _checks.check_inputs(_LAP, q, k, v, mask, causal=causal)
    _checks.check_causal_supported(_LAP, causal)
    _check_config(
        _LAP,
        num_landmarks=num_landmarks,
        ns_iters=ns_iters,
        grid=grid,
        inverse=inverse,
        eps=eps,
        normalize=(normalize, _LAP_NORMALIZE),
    )
    _check_impl(_LAP, impl)
    _check_lam(lam)
    _check_local_window(local_window)
    if not isinstance(shared_landmarks, bool):
        raise ValueError(
            f"{_LAP}: shared_landmarks must be True or False, got {shared_landmarks!r}"
        )
    _check_grid_fits(_LAP, grid, q, k)
    h = q.shape[2]
    expected = {"local": _local_shape(local_window, grid, h)} if local_window else {}
    if lam is None:
        expected["log_lam"] = (h,)
    elif params and "log_lam" in params:
        raise ValueError(
            f"{_LAP}: lam={lam!r} fixes lambda, but params carries 'log_lam'; init with the "
            "same lam (no params) or pass lam=None to learn it"
        )
    _checks.check_params(_LAP, params, expected)
    if lam is None:
        lam_h = jnp.exp(params["log_lam"].astype(_f32))
    else:
        lam_h = jnp.full((h,), lam, _f32)
    invert = _inverter(inverse, _LAP, ns_iters, eps, impl, interpret)
    return _nystrom(
        q.astype(_f32),
        k.astype(_f32),
        v,
        mask,
        _laplace_kappa(lam_h, impl, interpret),
        invert,
        num_landmarks=num_landmarks,
        grid=grid,
        normalize=normalize,
        output=output,
        shared_landmarks=shared_landmarks,
        local_w=params["local"].astype(_f32) if local_window else None,
        axis=axis,
    )


def laplacian_attention(
    q,
    k,
    v,
    params,
    rng=None,
    *,
    mask=None,
    causal=False,
    deterministic=False,
    num_landmarks=64,
    ns_iters=LAP_NS_ITERS,
    eps=0.01,
    lam=None,
    grid=None,
    inverse="iterative",
    normalize="injective",
    local_window=3,
    shared_landmarks=True,
    impl="auto",
    interpret=False,
):
    """LaplacianFormer attention ``[B, Tq, H, Dv]`` in q's dtype; see the module docstring.

    Args:
      params: from `laplacian_init`: ``"log_lam" [H]`` when ``lam`` is None and
        ``"local"`` when ``local_window > 0``.
      num_landmarks: m, the number of landmarks.
      ns_iters: Newton-Schulz iterations.
      eps: the Newton-Schulz regulariser, ``P = A + eps I``.
      lam: None (learnable ``exp(params["log_lam"])``, init d / 2) or a fixed lambda > 0
        (the paper's models use 4).
      grid: optional ``(h, w)``: the last ``h * w`` tokens are an image (2-D landmarks and
        a ``w x w`` local branch).
      inverse: ``"iterative"`` (Newton-Schulz) or ``"exact"`` (``(A + eps I)^-1`` by an LU
        solve).
      normalize: ``"injective"`` (the paper: whitened ``c^ A^+ C_k V``), ``"uncentered"``
        (``c`` divided by its root mean square over the queries), ``"row"`` (divided by
        ``c A^+ C_k 1``) or ``"none"`` (plain Nystrom ``c A^+ C_k V``).
      local_window: w, the local branch's window (odd; 0 = off).
      shared_landmarks: A and C_k from the key landmarks on both sides (symmetric A; the
        default, see the module docstring) or, when False, query landmarks on the left.
      impl, interpret: passed to `kernels.laplace_kernel` and
        `kernels.newton_schulz_inverse`.
    """
    del rng, deterministic
    out = _laplacian(
        q, k, v, params, mask, causal, num_landmarks, ns_iters, eps, lam, grid, inverse,
        normalize, local_window, shared_landmarks, impl, interpret, "linear",
    )  # fmt: skip
    return out.astype(q.dtype)


def laplacian_reference(
    q,
    k,
    v,
    params,
    rng=None,
    *,
    mask=None,
    causal=False,
    deterministic=False,
    num_landmarks=64,
    ns_iters=LAP_NS_ITERS,
    eps=0.01,
    lam=None,
    grid=None,
    inverse="iterative",
    normalize="injective",
    local_window=3,
    shared_landmarks=True,
    impl="auto",
    interpret=False,
):
    """`laplacian_attention` with ``c^ A^+ C_k`` and the local branch materialised
    (``[B, H, Tq, Tk]``)."""
    del rng, deterministic
    out = _laplacian(
        q, k, v, params, mask, causal, num_landmarks, ns_iters, eps, lam, grid, inverse,
        normalize, local_window, shared_landmarks, impl, interpret, "reference",
    )  # fmt: skip
    return out.astype(q.dtype)


def laplacian_weights(
    q,
    k,
    params,
    *,
    mask=None,
    num_landmarks=64,
    ns_iters=LAP_NS_ITERS,
    eps=0.01,
    lam=None,
    grid=None,
    inverse="iterative",
    normalize="injective",
    local_window=3,
    shared_landmarks=True,
    impl="auto",
    interpret=False,
):
    """Effective LaplacianFormer weights ``[B, H, Tq, Tk]`` float32 (``out = weights @ v``),
    the local branch included."""
    v = jnp.zeros(k.shape[:3] + (1,), _f32)
    return _laplacian(
        q, k, v, params, mask, False, num_landmarks, ns_iters, eps, lam, grid, inverse,
        normalize, local_window, shared_landmarks, impl, interpret, "weights",
    )  # fmt: skip


# --------------------------------------------------------------------------- registration

NYSTROMFORMER = register(
    Mechanism(
        name="nystromformer",
        init_fn=nystromformer_init,
        attention_fn=nystromformer_attention,
        reference_fn=nystromformer_reference,
        supports_causal=False,
        stochastic=False,
        description="Nystrom approximation of softmax attention, iterative pseudo-inverse "
        "(Xiong et al. 2021), O(T m)",
    )
)

SOFT = register(
    Mechanism(
        name="soft",
        init_fn=soft_init,
        attention_fn=soft_attention,
        reference_fn=soft_reference,
        supports_causal=False,
        stochastic=False,
        description="Nystrom approximation of a Gaussian kernel, Newton-Schulz inverse "
        "(Lu et al. 2021), O(T m)",
    )
)

LAPLACIAN = register(
    Mechanism(
        name="laplacian",
        init_fn=laplacian_init,
        attention_fn=laplacian_attention,
        reference_fn=laplacian_reference,
        supports_causal=False,
        stochastic=False,
        description="Nystrom approximation of a Laplace kernel with an injective feature map, "
        "Newton-Schulz inverse (LaplacianFormer), O(T m)",
    )
)

__all__ = [
    "WHITEN_EPS",
    "iterative_pinv",
    "nystromformer_init",
    "nystromformer_attention",
    "nystromformer_reference",
    "nystromformer_weights",
    "soft_init",
    "soft_attention",
    "soft_reference",
    "soft_weights",
    "laplacian_init",
    "laplacian_attention",
    "laplacian_reference",
    "laplacian_weights",
    "NYSTROMFORMER",
    "SOFT",
    "LAPLACIAN",
]
