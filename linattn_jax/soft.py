"""SOFT: Nystrom approximation of a Gaussian kernel (non-causal, O(T m)).

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

The landmarks, masks, inverses and the ``reference`` / ``*_weights`` outputs are the
shared core's, `linattn_jax.nystrom_core`.
"""

from __future__ import annotations

import jax.numpy as jnp

from linattn_jax import _checks, core
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
SOFT_NS_ITERS = 20


def _gaussian_kappa(x, y, col_valid, axis=None):
    """``exp(-|x - y|^2 / 2)`` (x, y already scaled by d^-1/4)."""
    del axis  # entrywise
    return jnp.exp(-0.5 * sq_dist(x, y)) * col_valid[:, None, None, :]


# --------------------------------------------------------------------------- soft

_SOFT = "soft"
_SOFT_NORMALIZE = ("none", "row")


def soft_body(
    q, k, v, mask, causal, num_landmarks, ns_iters, eps, grid, inverse, normalize, tie_qk,
    impl, interpret, output, axis=None,
):  # fmt: skip
    """The computation behind `soft_attention`, `soft_reference` and `soft_weights`
    (`output`: ``"linear"``, ``"reference"``, ``"weights"``), with positional config and
    the sequence-parallel mesh `axis` (None: one device); what `linattn_jax.parallel` runs
    on each shard."""
    _checks.check_inputs(_SOFT, q, k, v, mask, causal=causal)
    _checks.check_causal_supported(_SOFT, causal)
    check_nystrom_config(
        _SOFT,
        num_landmarks=num_landmarks,
        ns_iters=ns_iters,
        grid=grid,
        inverse=inverse,
        eps=eps,
        normalize=(normalize, _SOFT_NORMALIZE),
    )
    check_impl(_SOFT, impl)
    if not (tie_qk is True or tie_qk is False or tie_qk == "auto"):
        raise ValueError(f"{_SOFT}: tie_qk must be True, False or 'auto', got {tie_qk!r}")
    if tie_qk is True and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"{_SOFT}: tie_qk=True evaluates the key side of the kernel on q (as SOFT), which "
            f"needs Tq == Tk; got q {q.shape}, k {k.shape}. Pass tie_qk='auto' or False for "
            "cross-attention."
        )
    tie = tie_qk is True or (tie_qk == "auto" and q.shape[1] == k.shape[1])
    check_grid_fits(_SOFT, grid, q, k)
    qx = core.scale_inputs(q)
    kx = qx if tie else core.scale_inputs(k)
    invert = inverter(inverse, _SOFT, ns_iters, eps, impl, interpret)
    return nystrom(
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
      impl: passed to `kernels.newton_schulz_inverse`.
      interpret: passed to `kernels.newton_schulz_inverse`.
    """
    del params, rng, deterministic
    out = soft_body(
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
    out = soft_body(
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
    return soft_body(
        q, k, v, mask, False, num_landmarks, ns_iters, eps, grid, inverse, normalize, tie_qk,
        impl, interpret, "weights",
    )  # fmt: skip


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

__all__ = [
    "SOFT_NS_ITERS",
    "soft_init",
    "soft_attention",
    "soft_reference",
    "soft_weights",
    "SOFT",
]
