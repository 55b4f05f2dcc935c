"""Nystromformer: Nystrom approximation of softmax attention (non-causal, O(T m)).

* ``nystromformer`` (Xiong et al. 2021): kappa is the row softmax of scaled dot
  products, ``softmax(Q K~^T / sqrt d)``, ``softmax(Q~ K~^T / sqrt d)``,
  ``softmax(Q~ K^T / sqrt d)`` (masked keys excluded from the last), and ``A^+``
  is the paper's iterative pseudo-inverse
  ``Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4`` from
  ``Z_0 = A^T / (max_j sum_i |A_ij| * max_i sum_j |A_ij|)`` (``ns_iters``
  iterations, default 6). The scale of ``Z_0`` is taken per batch row and head
  (the paper's code takes it over the whole batch), so rows of a batch stay
  independent. Output ``C_q Z (C_k V)``.

The landmarks, masks, inverses and the ``reference`` / ``*_weights`` outputs are the
shared core's, `linattn_jax.nystrom_core`.
"""

from __future__ import annotations

import jax.numpy as jnp

from linattn_jax import _checks, _seq, core
from linattn_jax.nystrom_core import (
    check_grid_fits,
    check_nystrom_config,
    inverter,
    nystrom,
)
from linattn_jax.registry import Mechanism, register

_f32 = jnp.float32


def _softmax_kappa(x, y, col_valid, axis=None):
    """Row softmax of ``x y^T`` over the unmasked columns (x, y already scaled by d^-1/4)."""
    logits = jnp.einsum("bhnd,bhmd->bhnm", x, y)
    valid = col_valid[:, None, None, :]
    mx = _seq.masked_max(logits, valid, -1, axis)
    e = jnp.where(valid, jnp.exp(jnp.where(valid, logits - mx, 0.0)), 0.0)
    den = _seq.psum(jnp.sum(e, axis=-1, keepdims=True), axis)
    return e / jnp.where(den > 0, den, 1.0)


# --------------------------------------------------------------------------- nystromformer

_NF = "nystromformer"


def nystromformer_body(
    q, k, v, mask, causal, num_landmarks, ns_iters, grid, inverse, output, axis=None
):  # fmt: skip
    """The computation behind `nystromformer_attention`, `nystromformer_reference` and
    `nystromformer_weights` (`output`: ``"linear"``, ``"reference"``, ``"weights"``), with
    positional config and the sequence-parallel mesh `axis` (None: one device); what
    `linattn_jax.parallel` runs on each shard."""
    _checks.check_inputs(_NF, q, k, v, mask, causal=causal)
    _checks.check_causal_supported(_NF, causal)
    check_nystrom_config(
        _NF, num_landmarks=num_landmarks, ns_iters=ns_iters, grid=grid, inverse=inverse
    )
    check_grid_fits(_NF, grid, q, k)
    invert = inverter(inverse, _NF, ns_iters, 0.0, "xla", False)
    return nystrom(
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
    out = nystromformer_body(
        q, k, v, mask, causal, num_landmarks, ns_iters, grid, inverse, "linear"
    )
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
    out = nystromformer_body(
        q, k, v, mask, causal, num_landmarks, ns_iters, grid, inverse, "reference"
    )
    return out.astype(q.dtype)


def nystromformer_weights(
    q, k, params=None, *, mask=None, num_landmarks=64, ns_iters=6, grid=None, inverse="iterative"
):
    """Effective weights ``C_q Z C_k`` as ``[B, H, Tq, Tk]`` float32 (``out = weights @ v``)."""
    del params
    v = jnp.zeros(k.shape[:3] + (1,), _f32)
    return nystromformer_body(
        q, k, v, mask, False, num_landmarks, ns_iters, grid, inverse, "weights"
    )


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

__all__ = [
    "nystromformer_init",
    "nystromformer_attention",
    "nystromformer_reference",
    "nystromformer_weights",
    "NYSTROMFORMER",
]
