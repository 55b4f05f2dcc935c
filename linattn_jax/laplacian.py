"""LaplacianFormer: Nystrom approximation of a Laplace kernel with an injective feature map
(non-causal, O(T m)).

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

  Gaussian ablation (config ``kernel="gaussian"``; default ``"laplace"``): the paper's
  claim is that the Laplace kernel beats the Gaussian one, whose ``|q - k|_2^2`` decays
  faster and over-suppresses mid-range pairs. To test the kernel alone, ``"gaussian"``
  swaps only kappa, ``exp(-|q - k|_2^2 / (c lambda))`` with c = sqrt(pi) (`GAUSSIAN_C`),
  and keeps everything else: the same lambda (learnable ``log_lam`` from the same init
  d / 2, or the fixed ``lam``), landmarks, local branch, normalisation and inverse. The
  bandwidth makes the two comparable at init: for q, k with independent unit-variance
  Gaussian coordinates ``E|q - k|_1 = 2 d / sqrt(pi)`` and ``E|q - k|_2^2 = 2 d``, so with
  c = sqrt(pi) both kernels have the mean exponent ``4 / sqrt(pi) = 2.26`` at
  lambda = d / 2, whatever d: on such q, k the median entries are 0.102 (Laplace) and
  0.108 (Gaussian) at d = 16, 0.106 and 0.108 at d = 64 (printed by ``pytest -s
  tests/test_laplacian.py -k test_gaussian_bandwidth_matches_laplace_at_init``). On the real
  models' q, k at init (the models above) the median squared L2 distance is 1.9 d - 2.0 d
  and the median entries agree, Laplace 0.10 - 0.11 and Gaussian 0.10 - 0.12, the
  Gaussian's spreading wider (10% - 90% quantiles 0.032 - 0.27 against 0.055 - 0.18;
  ``python -m train.bench_activations --sections kernels``, docs/activations.md). How the
  two differ away from the median, and what that does to training, is what the comparison
  measures. The squared distances are ``|x|^2 + |y|^2 - 2 x.y`` (one full-precision
  matmul, plain jnp, no Pallas kernel), clamped at 0.

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
  then symmetric positive definite (both kernels are positive definite), so
  ``A + eps I`` has sigma_min >= eps and Newton-Schulz converges. Nystromformer's separate
  query landmarks (``shared_landmarks=False``, ``A = kappa(Q~, K~)``) give a non-symmetric
  A which, on the real activations at init (ListOps mini, ViT mini, DeiT-tiny), is nearly
  singular: Newton-Schulz has not converged after the default ``ns_iters`` and float32
  diverges on DeiT-tiny by 60 steps, where the shared form converges and is stable
  (docs/activations.md, ``python -m train.bench_activations --sections laplacian``). Both
  forms estimate the same K: ``C_q A^+ C_k`` is exact when the landmarks are all the keys.

  Local branch (the paper's depthwise convolution on V, added to the global output):
  config ``local_window`` w (odd; 0 = off; default 3), params ``"local"`` ``[w, H]`` (along
  the sequence, zero padded) or ``[w, w, H]`` (over the ``grid`` image, whose leading tokens,
  e.g. CLS, get no local term). One filter per head, shared by the head's Dv channels (the
  paper's convolution has one per channel; init knows only head_dim, and v's width may
  differ); init uniform in ``+-1/sqrt(w)`` (``+-1/w`` on the grid), PyTorch's default.
  Masked keys are zeroed before the convolution, so they contribute nothing. Only for
  self-attention (Tq == Tk); in cross-attention there is no token alignment and it is off.

The landmarks, masks, inverses and the ``reference`` / ``*_weights`` outputs are the
shared core's, `linattn_jax.nystrom_core`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

import kernels
from linattn_jax import _checks
from linattn_jax.nystrom_core import (
    check_grid_fits,
    check_impl,
    check_nystrom_config,
    inverter,
    nystrom,
    sq_dist,
)
from linattn_jax.registry import Mechanism, register

_f32 = jnp.float32


#: Default Newton-Schulz iterations (measurements: `linattn_jax.nystrom_core`).
LAP_NS_ITERS = 30


#: c of ``kernel="gaussian"``, ``exp(-|q - k|_2^2 / (c lambda))``: sqrt(pi) gives it the
#: Laplace kernel's mean exponent at the same lambda (see the module docstring).
GAUSSIAN_C = math.sqrt(math.pi)


def _laplace_kappa(lam, impl, interpret):
    """``exp(-|x - y|_1 / lam_h)`` with lam ``[H]`` (`kernels.laplace_kernel`, exp fused)."""

    def kappa(x, y, col_valid, axis=None):
        del axis  # entrywise
        k = kernels.laplace_kernel(x, y, lam, impl=impl, interpret=interpret)  # lam: [H]
        return k * col_valid[:, None, None, :]

    return kappa


def _gaussian_kappa(lam):
    """``exp(-|x - y|_2^2 / (c lam_h))`` with lam ``[H]``, c = `GAUSSIAN_C` (plain jnp; the
    squared distances by a full-precision matmul, clamped at 0)."""
    inv = (1.0 / (GAUSSIAN_C * lam))[None, :, None, None]

    def kappa(x, y, col_valid, axis=None):
        del axis  # entrywise
        sq = sq_dist(x, y, precision=lax.Precision.HIGHEST)
        return jnp.exp(-sq * inv) * col_valid[:, None, None, :]

    return kappa


# --------------------------------------------------------------------------- laplacian

_LAP = "laplacian"
_LAP_NORMALIZE = ("injective", "uncentered", "row", "none")
_LAP_KERNELS = ("laplace", "gaussian")


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


def laplacian_body(
    q, k, v, params, mask, causal, num_landmarks, ns_iters, eps, lam, kernel, grid, inverse,
    normalize, local_window, shared_landmarks, impl, interpret, output, axis=None,
):  # fmt: skip
    """The computation behind `laplacian_attention`, `laplacian_reference` and
    `laplacian_weights` (`output`: ``"linear"``, ``"reference"``, ``"weights"``), with
    positional config and the sequence-parallel mesh `axis` (None: one device); what
    `linattn_jax.parallel` runs on each shard."""
    _checks.check_inputs(_LAP, q, k, v, mask, causal=causal)
    _checks.check_causal_supported(_LAP, causal)
    check_nystrom_config(
        _LAP,
        num_landmarks=num_landmarks,
        ns_iters=ns_iters,
        grid=grid,
        inverse=inverse,
        eps=eps,
        normalize=(normalize, _LAP_NORMALIZE),
    )
    check_impl(_LAP, impl)
    _check_lam(lam)
    _checks.check_choice(_LAP, "kernel", kernel, _LAP_KERNELS)
    _check_local_window(local_window)
    _checks.check_bool(_LAP, "shared_landmarks", shared_landmarks)
    check_grid_fits(_LAP, grid, q, k)
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
    invert = inverter(inverse, _LAP, ns_iters, eps, impl, interpret)
    if kernel == "laplace":
        kappa = _laplace_kappa(lam_h, impl, interpret)
    else:
        kappa = _gaussian_kappa(lam_h)
    return nystrom(
        q.astype(_f32),
        k.astype(_f32),
        v,
        mask,
        kappa,
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
    kernel="laplace",
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
      kernel: ``"laplace"`` (the paper's ``exp(-|q - k|_1 / lambda)``) or ``"gaussian"``
        (``exp(-|q - k|_2^2 / (sqrt(pi) lambda))``, the ablation of the Laplace kernel: the
        same lambda, landmarks, local branch, normalisation and inverse).
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
      impl: passed to `kernels.laplace_kernel` (the Laplace kernel; the Gaussian one is
        plain jnp) and `kernels.newton_schulz_inverse`.
      interpret: passed to the same kernels as `impl`.
    """
    del rng, deterministic
    out = laplacian_body(
        q, k, v, params, mask, causal, num_landmarks, ns_iters, eps, lam, kernel, grid,
        inverse, normalize, local_window, shared_landmarks, impl, interpret, "linear",
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
    kernel="laplace",
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
    out = laplacian_body(
        q, k, v, params, mask, causal, num_landmarks, ns_iters, eps, lam, kernel, grid,
        inverse, normalize, local_window, shared_landmarks, impl, interpret, "reference",
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
    kernel="laplace",
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
    return laplacian_body(
        q, k, v, params, mask, False, num_landmarks, ns_iters, eps, lam, kernel, grid,
        inverse, normalize, local_window, shared_landmarks, impl, interpret, "weights",
    )  # fmt: skip


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
    "LAP_NS_ITERS",
    "GAUSSIAN_C",
    "laplacian_lam_init",
    "laplacian_init",
    "laplacian_attention",
    "laplacian_reference",
    "laplacian_weights",
    "LAPLACIAN",
]
