"""Randomized attention (RA), Zheng et al. 2022 (seed 004): unbiased for softmax, O(T^2).

``ra`` samples the query-specific proposal p_n exactly (notation, random draws and
gradients: `linattn_jax.ra_common`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from linattn_jax import _checks, core
from linattn_jax.ra_common import _check_samples, _masked_softmax, _sq_half
from linattn_jax.registry import Mechanism, register

_f32 = jnp.float32


def ra_init(rng, *, num_heads: int, head_dim: int):
    """RA has no params."""
    del rng, num_heads, head_dim
    return {}


def _ra_valid(mask, causal, b, tq, tk):
    """``[B, 1, Tq, Tk]`` bool: which keys each query may attend to."""
    valid = core.key_mask(mask, tk, b)[:, None, None, :]
    if causal:
        valid = valid & jnp.tril(jnp.ones((tq, tk), bool))[None, None]
    return valid


def ra_draws(key, batch: int, q_len: int, num_heads: int, head_dim: int):
    """One RA draw per query: ``(u [B, H, Tq] ~ U(0, 1), eps [B, Tq, H, d] ~ N(0, I))``.

    Query n's values come from one ``normal(fold_in(key, n), (B, H, d + 1))``: the
    first d coordinates are eps and ``u = Phi(z_d)`` (the normal CDF of the last one
    is uniform). Indexed by position, they do not depend on the sequence length
    (padding-invariant); one Gaussian draw per position keeps the traced RNG small.
    """
    z = jax.vmap(
        lambda n: jax.random.normal(
            jax.random.fold_in(key, n), (batch, num_heads, head_dim + 1), _f32
        )
    )(jnp.arange(q_len))  # [Tq, B, H, d + 1]
    u = jax.scipy.special.ndtr(z[..., head_dim])
    return jnp.transpose(u, (1, 2, 0)), jnp.transpose(z[..., :head_dim], (1, 0, 2, 3))


def _sample_keys(rng, num_samples):
    """Keys of the S independent RA draws: `rng` itself for S = 1, else ``split(rng, S)``.

    So ``ra(num_samples=S, rng)`` is exactly the mean of ``ra(num_samples=1, key)``
    over ``key in split(rng, S)``.
    """
    if num_samples == 1:
        return rng[None]
    return jax.random.split(rng, num_samples)


def _check_ra(q, k, v, mask, causal, rng, deterministic, num_samples):
    _checks.check_inputs("ra", q, k, v, mask, causal=causal)
    _check_samples("ra", rng, deterministic, num_samples)


def ra_attention(
    q, k, v, params, rng=None, *, mask=None, causal=False, deterministic=False, num_samples=1
):
    """Randomized attention (RA), ``[B, Tq, H, Dv]`` in q's dtype. Quadratic, unbiased.

    Per query n (paper eq. for RA): ``pi_n = softmax_m(q^_n . k^_m)`` over the keys
    it may attend to; draw ``m* ~ pi_n``, ``eps ~ N(0, I)``, ``omega_n = q^_n +
    k^_{m*} + eps`` and return ``f_n(omega_n) = sum_j softmax_j(omega_n . k^_j -
    |k^_j|^2 / 2) v_j``. ``E[out_n]`` is exactly softmax attention. `num_samples`
    S > 1 averages S independent draws (a `lax.scan`, one ``[B, H, Tq, Tk]`` score
    matrix live at a time; the body is rematerialised for the backward pass).
    ``deterministic=True``: ``omega_n = q^_n + sum_m pi_nm k^_m`` (no rng).

    Unbiasedness needs the noise to match the proposal density: eps has unit variance in
    the scaled space, as the paper writes it. The official RA (HKUNLP efficient-attention)
    adds its noise before the ``d^(-1/4)`` scaling (an effective std of ``d^(-1/4)``), which
    makes it biased: its error vs softmax levels off at 0.035 where ours is 0.012 at 2048
    samples (figures reported in issue 14, not rerun here).

    Args:
      q: ``[B, Tq, H, Dk]``; k: ``[B, Tk, H, Dk]``; v: ``[B, Tk, H, Dv]``.
      params: ``{}``.
      rng: a `jax.random.key` (needed unless deterministic).
      mask: ``[B, Tk]`` bool key padding (True = attend).
      causal: query i sees keys j <= i, in both pi_i and the softmax of f_i.
      num_samples: S, independent draws averaged.
    """
    del params
    _check_ra(q, k, v, mask, causal, rng, deterministic, num_samples)
    b, tq, h, d = q.shape
    tk = k.shape[1]
    qh, kh, v32 = core.scale_inputs(q), core.scale_inputs(k), v.astype(_f32)
    valid = _ra_valid(mask, causal, b, tq, tk)  # [B, 1, Tq, Tk]
    pi = _masked_softmax(jnp.einsum("bihd,bjhd->bhij", qh, kh), valid, -1)  # [B, H, Tq, Tk]
    k_bias = jnp.transpose(_sq_half(kh), (0, 2, 1))[:, :, None, :]  # [B, H, 1, Tk]
    kh_h = jnp.transpose(kh, (0, 2, 1, 3))  # [B, H, Tk, d]

    def f(omega):  # [B, Tq, H, d] -> [B, Tq, H, Dv]
        w = _masked_softmax(jnp.einsum("bihd,bjhd->bhij", omega, kh) - k_bias, valid, -1)
        return jnp.einsum("bhij,bjhd->bihd", w, v32)

    if deterministic:
        return f(qh + jnp.einsum("bhij,bjhd->bihd", pi, kh)).astype(q.dtype)

    # Inverse-CDF sampling of m* (see the module docstring); no gradient through the choice.
    cdf = jnp.cumsum(lax.stop_gradient(pi), axis=-1)  # [B, H, Tq, Tk]
    last = jnp.max(jnp.where(pi > 0, jnp.arange(tk), 0), axis=-1)  # [B, H, Tq]

    def one(key):
        u, eps = ra_draws(key, b, tq, h, d)
        idx = jnp.sum(cdf <= (u * cdf[..., -1])[..., None], axis=-1)  # first j with cdf_j > u
        idx = jnp.minimum(idx, last)  # u * total rounded up to total: the last valid key
        k_star = jnp.take_along_axis(kh_h, idx[..., None], axis=2)  # [B, H, Tq, d]
        return f(qh + jnp.transpose(k_star, (0, 2, 1, 3)) + eps)

    keys = _sample_keys(rng, num_samples)
    if num_samples == 1:
        return one(keys[0]).astype(q.dtype)

    def body(acc, key):
        return acc + one(key), None

    acc0 = jnp.zeros((b, tq, h, v.shape[-1]), _f32)
    total, _ = lax.scan(jax.checkpoint(body), acc0, keys)
    return (total / num_samples).astype(q.dtype)


def ra_reference(
    q, k, v, params, rng=None, *, mask=None, causal=False, deterministic=False, num_samples=1
):
    """Naive RA with the same draws: explicit softmax weights, one-hot key choice, stacked samples.

    Materialises ``[S, B, H, Tq, Tk]``. The test oracle of `ra_attention`.
    """
    del params
    _check_ra(q, k, v, mask, causal, rng, deterministic, num_samples)
    b, tq, h, d = q.shape
    tk = k.shape[1]
    qh, kh, v32 = core.scale_inputs(q), core.scale_inputs(k), v.astype(_f32)
    valid = jnp.broadcast_to(_ra_valid(mask, causal, b, tq, tk), (b, h, tq, tk))
    any_valid = jnp.any(valid, axis=-1, keepdims=True)
    # pi from the unscaled logits q.k / sqrt(d), as the softmax oracle writes them.
    logits = jnp.einsum("bihd,bjhd->bhij", q.astype(_f32), k.astype(_f32)) * d**-0.5
    pi = jax.nn.softmax(jnp.where(valid, logits, -jnp.inf), axis=-1)
    pi = jnp.where(any_valid & valid, pi, 0.0)  # [B, H, Tq, Tk]

    def f(omega):
        scores = jnp.einsum("bihd,bjhd->bhij", omega, kh)
        scores = scores - 0.5 * jnp.einsum("bjhd,bjhd->bhj", kh, kh)[:, :, None, :]
        scores = jnp.where(valid, scores, -jnp.inf)
        w = jax.nn.softmax(jnp.where(any_valid, scores, 0.0), axis=-1)
        w = jnp.where(valid, w, 0.0)
        return jnp.einsum("bhij,bjhd->bihd", w, v32)

    if deterministic:
        return f(qh + jnp.einsum("bhij,bjhd->bihd", pi, kh)).astype(q.dtype)
    outs = []
    for key in _sample_keys(rng, num_samples):
        u, eps = ra_draws(key, b, tq, h, d)
        cdf = jnp.cumsum(pi, axis=-1)
        above = cdf > (u * cdf[..., -1])[..., None]
        last = tk - 1 - jnp.argmax(jnp.flip(pi > 0, axis=-1), axis=-1)
        idx = jnp.where(jnp.any(above, -1), jnp.argmax(above, axis=-1), last)  # [B, H, Tq]
        onehot = jax.nn.one_hot(idx, tk, dtype=_f32)
        k_star = jnp.einsum("bhij,bjhd->bihd", onehot, kh)
        outs.append(f(qh + k_star + eps))
    return jnp.mean(jnp.stack(outs), axis=0).astype(q.dtype)


RA = register(
    Mechanism(
        name="ra",
        init_fn=ra_init,
        attention_fn=ra_attention,
        reference_fn=ra_reference,
        supports_causal=True,
        stochastic=True,
        description="randomized attention, unbiased for softmax (Zheng et al. 2022), O(T^2)",
    )
)

__all__ = [
    "RA",
    "ra_attention",
    "ra_draws",
    "ra_init",
    "ra_reference",
]
