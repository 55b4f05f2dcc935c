"""Linear attention's entry points: `linear_attention` (the non-causal form as two
einsums; the causal form from `linattn_jax.core.causal`), its naive oracle
`quadratic_reference`, `attend` / `attend_features` (what every feature-map mechanism ends
with) and `normalized_weights`."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from linattn_jax.core.causal import _causal_chunked, _causal_fused
from linattn_jax.core.common import (
    DENOMINATOR_EPS,
    _apply_key_mask,
    _check_floor,
    _check_one_key_weighting,
    _f32,
    _masked_log_scale,
    _read_out_heads_first,
    _split_mass,
    denominator_floor,
    guard_denominator,
)
from linattn_jax.core.features import FeatureMap


def linear_attention(
    phi_q,
    phi_k,
    v,
    *,
    mask=None,
    causal: bool = False,
    chunk_size: int = 64,
    log_decay=None,
    key_log_scale=None,
    eps: float = DENOMINATOR_EPS,
    den_floor: float = 0.0,
):
    """Normalised linear attention from feature maps.

    Args:
      phi_q: ``[B, Tq, H, M]`` query features.
      phi_k: ``[B, Tk, H, M]`` key features.
      v: ``[B, Tk, H, Dv]`` values.
      mask: optional ``[B, Tk]`` bool key-padding mask (True = attend).
      causal: position i attends to j <= i (needs Tq == Tk).
      chunk_size: chunk length C of the causal form (any T; the tail is padded).
      log_decay: optional ``[B, T, H]`` log of a per-token decay g_t in (0, 1]
        (causal only): ``S_t = g_t S_{t-1} + phi(k_t) v_t^T``, likewise z.
      key_log_scale: optional ``[B, Tk, H]`` log of a per-key scale n_j: the key
        features are ``exp(n_j) phi_k[j]`` (e.g. Flexformer's norm factor). The
        scale is applied stably: a detached max of n is subtracted, over all
        unmasked keys when non-causal and as a running max over keys j <= i when
        causal, so no query's normaliser ever depends on future keys.
      eps: denominator guard, see `guard_denominator`.
      den_floor: the relative denominator floor gamma in [0, 1) (module docstring); when
        > 0 the last feature column must be the key-mass channel (`mass_channel`).

    Returns:
      ``[B, Tq, H, Dv]`` float32.
    """
    _check_floor(den_floor, phi_k)
    phi_q, phi_k, v = phi_q.astype(_f32), phi_k.astype(_f32), v.astype(_f32)
    phi_k = _apply_key_mask(phi_k, mask)
    ns = _masked_log_scale(key_log_scale, mask, phi_k.shape[:3])
    _check_one_key_weighting(log_decay, key_log_scale)
    if not causal:
        if log_decay is not None:
            raise ValueError("linear_attention: log_decay needs causal=True")
        # heads first as in `read_out`, swapped before the mass channel is split off, so
        # that a feature map's own swap (`heads_last`) cancels and the split is free
        pq, pk = jnp.swapaxes(phi_q, 1, 2), jnp.swapaxes(phi_k, 1, 2)  # [B, H, T, M]
        pq, pk, mass = _split_mass(pq, pk, den_floor)
        wk = jnp.exp(ns - lax.stop_gradient(jnp.max(ns, axis=1, keepdims=True)))  # [B, Tk, H]
        # the key weights go on v (Dv wide), not on phi_k (M wide)
        kv = jnp.einsum("bhtm,bthd->bhmd", pk, v * wk[..., None])
        z = jnp.einsum("bhtm,bth->bhm", pk, wk)
        key_mass = None if mass is None else jnp.sum(mass * jnp.swapaxes(wk, 1, 2), axis=2)
        return _read_out_heads_first(pq, kv, z, key_mass, eps, den_floor)
    return _causal_chunked(phi_q, phi_k, v, chunk_size, log_decay, ns, eps, den_floor=den_floor)[0]


def quadratic_reference(
    phi_q,
    phi_k,
    v,
    *,
    mask=None,
    causal: bool = False,
    log_decay=None,
    key_log_scale=None,
    eps=DENOMINATOR_EPS,
    den_floor: float = 0.0,
):
    """The naive quadratic form of `linear_attention`: materialises ``[B, H, Tq, Tk]``.

    ``A_ij = phi(q_i) . phi(k_j) exp(n_j - c_i)`` with c_i the (detached) max of the
    key log-scales visible to query i; when causal also times ``tril`` and
    ``exp(G_i - G_j)``; ``out = A V / guard(rowsum A)``. Same arguments and result
    as `linear_attention`.
    """
    _check_floor(den_floor, phi_k)
    phi_q, phi_k, v = phi_q.astype(_f32), phi_k.astype(_f32), v.astype(_f32)
    phi_k = _apply_key_mask(phi_k, mask)
    ns = _masked_log_scale(key_log_scale, mask, phi_k.shape[:3]).transpose(0, 2, 1)  # [B, H, T]
    if causal:
        t = ns.shape[-1]
        tril = jnp.tril(jnp.ones((t, t), bool))
        c = lax.stop_gradient(lax.cummax(ns, axis=2))  # running max over j <= i
        logw = ns[..., None, :] - c[..., :, None]
        if log_decay is not None:
            g = jnp.cumsum(log_decay.astype(_f32), axis=1).transpose(0, 2, 1)  # [B, H, T]
            logw = logw + g[..., :, None] - g[..., None, :]
        w = jnp.where(tril, jnp.exp(jnp.where(tril, logw, 0.0)), 0.0)  # [B, H, Tq, Tk]
    else:
        c = lax.stop_gradient(jnp.max(ns, axis=-1, keepdims=True))
        w = jnp.exp(ns - c)[..., None, :]
    phi_q, phi_k, mass = _split_mass(phi_q, phi_k, den_floor)
    a = jnp.einsum("bihm,bjhm->bhij", phi_q, phi_k) * w
    num = jnp.einsum("bhij,bjhd->bihd", a, v)
    den = jnp.sum(a, axis=-1).transpose(0, 2, 1)
    floor = None
    if mass is not None:
        mass = jnp.sum(w * mass.transpose(0, 2, 1)[:, :, None, :], axis=-1)  # [B, H, Tq]
        floor = denominator_floor(phi_q, mass.transpose(0, 2, 1), den_floor)
    return num / guard_denominator(den, eps, floor)[..., None]


def attend(
    phi_q,
    phi_k,
    v,
    dtype,
    *,
    mask=None,
    causal=False,
    chunk_size=64,
    log_decay=None,
    key_log_scale=None,
    quadratic=False,
    den_floor=0.0,
):
    """`linear_attention` (or, with ``quadratic=True``, `quadratic_reference`) cast to `dtype`.

    The one call every feature-map mechanism ends with, so its fast path and its
    reference differ only in this flag.
    """
    kw = dict(
        mask=mask,
        causal=causal,
        log_decay=log_decay,
        key_log_scale=key_log_scale,
        den_floor=den_floor,
    )
    if quadratic:
        out = quadratic_reference(phi_q, phi_k, v, **kw)
    else:
        out = linear_attention(phi_q, phi_k, v, chunk_size=chunk_size, **kw)
    return out.astype(dtype)


def normalized_weights(
    phi_q, phi_k, *, mask=None, causal: bool = False, eps=DENOMINATOR_EPS, den_floor=0.0
):
    """The effective attention weights ``A / rowsum A`` as ``[B, H, Tq, Tk]`` (for inspection,
    plots and distillation; quadratic memory); `den_floor` as in `linear_attention`."""
    _check_floor(den_floor, phi_k)
    phi_q, phi_k = phi_q.astype(_f32), _apply_key_mask(phi_k.astype(_f32), mask)
    a = jnp.einsum("bihm,bjhm->bhij", phi_q, phi_k)
    visible = jnp.ones(a.shape[-2:], bool)
    if causal:
        visible = jnp.tril(visible)
        a = jnp.where(visible, a, 0.0)
    floor = None
    if den_floor:
        mass = jnp.sum(
            jnp.where(visible, phi_k[..., -1].transpose(0, 2, 1)[:, :, None, :], 0.0), -1
        )
        floor = denominator_floor(phi_q, mass.transpose(0, 2, 1), den_floor).transpose(0, 2, 1)[
            ..., None
        ]
    return a / guard_denominator(jnp.sum(a, axis=-1, keepdims=True), eps, floor)


def attend_features(
    fmap: FeatureMap,
    q,
    k,
    v,
    params,
    rng=None,
    *,
    mask=None,
    causal: bool = False,
    deterministic: bool = False,
    chunk_size: int = 64,
    quadratic: bool = False,
    **config,
):
    """A feature-map mechanism's attention from its `FeatureMap` (inputs already checked)."""
    params = fmap.resolve(params, rng, deterministic=deterministic, **config)
    if causal and fmap.token_wise and not quadratic:
        floor = fmap.den_floor(**config)
        return _causal_fused(fmap, params, q, k, v, mask, chunk_size, floor, config).astype(q.dtype)
    keys = fmap.key(k, params, **config)
    return attend(
        fmap.query(q, params, **config),
        keys.phi,
        v,
        q.dtype,
        mask=mask,
        causal=causal,
        chunk_size=chunk_size,
        log_decay=keys.log_decay,
        key_log_scale=keys.log_scale,
        quadratic=quadratic,
        den_floor=fmap.den_floor(**config),
    )
