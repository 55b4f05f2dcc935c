"""The pieces every path of the core shares: the denominator guard and its relative floor,
the key-mass channel, masks and key log-scales, and the read-out from key summaries.

See `linattn_jax.core` for the relative denominator floor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

#: Denominators with ``|r| <= DENOMINATOR_EPS`` are pushed away from zero. Not a modelling
#: constant but float32's limit: the guard is for a row with no visible key (den exactly 0)
#: and for underflow, never for a well-defined row. The feature maps keep their
#: denominators far above it relative to the data (each positive feature carries an eps
#: relative to its token's largest feature, so ``phi(q) . phi(k)`` cannot underflow), and
#: a tiny positive denominator of positive weights is divided exactly (its numerator is as
#: small). At 1e-18 the gradient of the ratio, ``num / den^2``, stays finite in float32
#: (1 / (2 eps)^2 < 3.4e38). An absolute 1e-6 here shrank every output whose stabilised
#: denominator fell below it (performer and hedgehog at input scales >= 10).
DENOMINATOR_EPS = 1e-18

_f32 = jnp.float32
#: Added under the square roots of feature norms: an all-zero feature row gets a finite
#: (zero) gradient instead of NaN.
_TINY_SQ = 1e-30


def _unit_axis_on_cpu(shape) -> bool:
    """Whether an operand of `shape` ``[..., D]`` has a unit axis before D and the default
    backend is the CPU: there XLA (jaxlib 0.10) fuses ``sum(a * b, -1)`` into a
    multiply-reduce that runs 8-20x slower than the same sum as a contraction (``[1, 512,
    4, 64]``: 0.41 ms against 0.045 ms), and the transpose of a broadcast multiply is that
    multiply-reduce. Without a unit axis the plain forms are as fast or faster in context
    (docs/performance.md, "row reductions at batch 1")."""
    return 1 in shape[:-1] and jax.default_backend() == "cpu"


def rowdot(a, b):
    """``sum(a * b, axis=-1)`` (``[..., D], [..., D] -> [...]``); as a contraction where
    XLA's CPU multiply-reduce is slow (`_unit_axis_on_cpu`: at batch 1)."""
    if _unit_axis_on_cpu(a.shape):
        return jnp.einsum("...d,...d->...", a, b, precision=lax.Precision.HIGHEST)
    return jnp.sum(a * b, axis=-1)


def scale_rows(x, r):
    """``x * r[..., None]`` (``[..., D], [...] -> [..., D]``); where XLA's CPU
    multiply-reduce is slow (`_unit_axis_on_cpu`), written as a product whose gradient with
    respect to `r` is a contraction (the broadcast's transpose would be that reduce)."""
    if _unit_axis_on_cpu(x.shape):
        return jnp.einsum("...d,...->...d", x, r, precision=lax.Precision.HIGHEST)
    return x * r[..., None]


def divide_rows(x, den):
    """``x / den[..., None]``, as `scale_rows` of ``1 / den`` where that is faster."""
    if _unit_axis_on_cpu(x.shape):
        return scale_rows(x, 1.0 / den)
    return x / den[..., None]


def guard_denominator(den, eps: float = DENOMINATOR_EPS, floor=None):
    """Pushes ``|den| <= eps`` away from zero: ``den + 2 eps sign(den)`` (sign(0) := +1).

    This is the Performer sin/cos variant's guard: it leaves every well-scaled
    denominator unchanged, works for features that can be negative (trigonometric
    random features), and makes an all-zero row (every key masked) divide its
    zero numerator by ``2 eps`` instead of 0 (see `DENOMINATOR_EPS` for its size). With
    `floor` (an array broadcasting against `den`, >= 0; the relative floor of the module
    docstring, which keeps features that can cancel away from 0 relative to their terms)
    ``|den|`` is first raised to at least `floor`, keeping its sign.
    """
    sign = jnp.where(den < 0, -1.0, 1.0).astype(den.dtype)
    if floor is not None:
        den = jnp.where(jnp.abs(den) < floor, sign * floor, den)
    return jnp.where(jnp.abs(den) <= eps, den + 2 * eps * sign, den)


def mass_channel(phi, *, is_query: bool):
    """`phi` ``[..., M]`` with the key-mass channel appended (``[..., M + 1]``): a column of
    zeros for queries (dot products are unchanged) and ``|phi|`` for keys. A feature map
    with a relative denominator floor (`FeatureMap.den_floor`) returns its features so."""
    phi = phi.astype(_f32)
    extra = jnp.zeros_like(phi[..., :1]) if is_query else key_mass(phi)[..., None]
    return jnp.concatenate([phi, extra], axis=-1)


def key_mass(phi):
    """``|phi|`` over the last axis (``[..., M] -> [...]``): the key-mass channel's values."""
    return jnp.sqrt(rowdot(phi, phi) + _TINY_SQ)


def denominator_floor(phi_q, mass, den_floor):
    """The relative floor ``gamma |phi(q_i)| mass_i`` of `guard_denominator` (None when
    `den_floor` is 0); `phi_q` ``[..., M]`` in any layout (``[B, Tq, H, M]``, or heads first
    inside the core), `mass` broadcasting against its leading axes (the mass channel summed
    under the denominator's weights)."""
    if not den_floor:
        return None
    return den_floor * key_mass(phi_q) * mass


def append_ones(v):
    """``[v | 1]``: `v` ``[..., D]`` with a column of ones appended (``[..., D + 1]``), so
    that one product with the key features gives both ``sum phi(k) v^T`` and ``sum phi(k)``."""
    return jnp.concatenate([v, jnp.ones_like(v[..., :1])], axis=-1)


def heads_last(x):
    """``[B, H, T, ...] -> [B, T, H, ...]``: the layout the core takes. A feature map that
    computes heads first (its projection then writes each head's features contiguously)
    returns them through this; the core's own swap back to heads first cancels it."""
    return jnp.swapaxes(x, 1, 2)


def split_last(x):
    """``(x[..., :-1], x[..., -1])``: a ``[.. | last]`` product split into its two parts."""
    return x[..., :-1], x[..., -1]


def read_out(phi_q, s, z, mass=None, *, eps: float = DENOMINATOR_EPS, den_floor: float = 0.0):
    """Linear attention's output from the key summaries: ``phi_q S / guard(phi_q z)``.

    `phi_q` ``[B, Tq, H, M]``, `s` ``[B, H, M, Dv]`` (sum of phi(k) v^T), `z` ``[B, H, M]``
    (sum of phi(k)), `mass` ``[B, H]`` (the key-mass channel summed under the same weights;
    None without a floor) -> ``[B, Tq, H, Dv]``. The non-causal path, the recurrent step and
    the sequence-parallel reduction all end here."""
    # Heads first ([B, H, Tq, M]): each head's products run on contiguous rows. A feature
    # map that computes its features heads first and swaps them back (`heads_last`) has
    # this swap cancel against its own, so its M-wide features are never transposed.
    return read_out_heads_first(jnp.swapaxes(phi_q, 1, 2), s, z, mass, eps, den_floor)


def read_out_heads_first(pq, s, z, mass, eps, den_floor):
    """`read_out` of heads-first query features `pq` ``[B, H, Tq, M]``."""
    num = jnp.einsum("bhtm,bhmd->bhtd", pq, s)
    den = jnp.einsum("bhtm,bhm->bht", pq, z)
    floor = None if mass is None else denominator_floor(pq, mass[..., None], den_floor)
    return jnp.swapaxes(divide_rows(num, guard_denominator(den, eps, floor)), 1, 2)


def split_mass(phi_q, phi_k, den_floor, channel=True):
    """``(phi_q, phi_k, mass)``: the features without the mass channel and the channel
    ``[B, Tk, H]`` (None without a floor). The main sums then run on exactly the features
    of the unfloored call, so rows above the floor come out bit for bit the same. Without
    `channel` the features carry none, and the mass is ``|phi_k|`` (`key_mass`)."""
    phi_k, mass = split_key_mass(phi_k, den_floor, channel)
    return (phi_q[..., :-1] if den_floor and channel else phi_q), phi_k, mass


def split_key_mass(phi_k, den_floor, channel=True):
    """``(phi_k, mass)``: the key side of `split_mass`."""
    if not den_floor:
        return phi_k, None
    return split_last(phi_k) if channel else (phi_k, key_mass(phi_k))


def check_floor(den_floor, phi_k):
    """Raises ValueError unless `den_floor` is 0 / None or in ``(0, 1)`` with key features
    `phi_k` that carry the mass channel (`mass_channel`)."""
    if not den_floor:
        return
    if not 0.0 < den_floor < 1.0:
        raise ValueError(f"den_floor must be in [0, 1), got {den_floor!r}")
    if phi_k.shape[-1] < 2:
        raise ValueError(
            f"den_floor > 0 needs key features with the mass channel (`mass_channel`), got "
            f"phi_k {tuple(phi_k.shape)}"
        )


def masked_max(x, mask, axis):
    """Max of `x` over `axis` ignoring masked entries; 0 where everything is masked.

    `mask` broadcasts against `x`. Used for the detached stabilisers that cancel
    in the attention ratio.
    """
    neg = jnp.where(mask, x, -jnp.inf)
    m = jnp.max(neg, axis=axis, keepdims=True)
    return jnp.where(jnp.isfinite(m), m, 0.0)


def key_mask(mask, tk: int, batch: int):
    """``[B, Tk]`` bool key mask (all True when `mask` is None)."""
    if mask is None:
        return jnp.ones((batch, tk), bool)
    return mask


def check_one_key_weighting(log_decay, key_log_scale):
    """Raises ValueError when both a decay and key log-scales are given."""
    if log_decay is not None and key_log_scale is not None:
        raise ValueError("linear_attention: pass log_decay or key_log_scale, not both")


def apply_key_mask(phi_k, mask):
    """`phi_k` ``[B, Tk, H, M]`` with the keys where `mask` ``[B, Tk]`` is False zeroed
    (`phi_k` itself when `mask` is None)."""
    if mask is None:
        return phi_k
    return phi_k * mask[:, :, None, None].astype(phi_k.dtype)


#: Log-scale of masked (and padded) keys: finite, so differences never give NaN.
NEG_LOG_SCALE = -1e30


def masked_log_scale(key_log_scale, mask, shape):
    """``[B, Tk, H]`` float32 log-scales, `NEG_LOG_SCALE` at masked keys (0 when not given)."""
    ns = jnp.zeros(shape, _f32) if key_log_scale is None else key_log_scale.astype(_f32)
    if mask is not None:
        ns = jnp.where(mask[:, :, None], ns, NEG_LOG_SCALE)
    return ns
