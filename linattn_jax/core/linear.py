"""Linear attention's entry points: `linear_attention` (the non-causal form as two
einsums; the causal form from `linattn_jax.core.causal`), its naive oracle
`quadratic_reference`, `attend` / `attend_features` (what every feature-map mechanism ends
with; a token-wise map's long non-causal pass block by block, `noncausal_fused`) and
`normalized_weights`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from linattn_jax.core.causal import (
    causal_chunked,
    causal_fused,
    check_no_decay,
    chunking,
    mass_channel_config,
    token_chunks,
)
from linattn_jax.core.common import (
    DENOMINATOR_EPS,
    NEG_LOG_SCALE,
    apply_key_mask,
    check_floor,
    check_one_key_weighting,
    denominator_floor,
    guard_denominator,
    masked_log_scale,
    read_out_heads_first,
    scale_rows,
    split_key_mass,
    split_mass,
)
from linattn_jax.core.features import FeatureMap

_f32 = jnp.float32

#: Block length of the non-causal pass of a token-wise feature map over a long sequence
#: (`attend_features`, `noncausal_fused`).
NONCAUSAL_BLOCK = 512


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
    check_floor(den_floor, phi_k)
    phi_q, phi_k, v = phi_q.astype(_f32), phi_k.astype(_f32), v.astype(_f32)
    phi_k = apply_key_mask(phi_k, mask)
    ns = masked_log_scale(key_log_scale, mask, phi_k.shape[:3])
    check_one_key_weighting(log_decay, key_log_scale)
    if not causal:
        check_no_decay(log_decay)
        # heads first as in `read_out`, swapped before the mass channel is split off, so
        # that a feature map's own swap (`heads_last`) cancels and the split is free
        pq, pk = jnp.swapaxes(phi_q, 1, 2), jnp.swapaxes(phi_k, 1, 2)  # [B, H, T, M]
        pq, pk, mass = split_mass(pq, pk, den_floor)
        wk = jnp.exp(ns - lax.stop_gradient(jnp.max(ns, axis=1, keepdims=True)))  # [B, Tk, H]
        # the key weights go on v (Dv wide), not on phi_k (M wide)
        kv = jnp.einsum("bhtm,bthd->bhmd", pk, scale_rows(v, wk))
        z = jnp.einsum("bhtm,bth->bhm", pk, wk)
        key_mass = None if mass is None else jnp.sum(mass * jnp.swapaxes(wk, 1, 2), axis=2)
        return read_out_heads_first(pq, kv, z, key_mass, eps, den_floor)
    return causal_chunked(phi_q, phi_k, v, chunk_size, log_decay, ns, eps, den_floor=den_floor)[0]


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
    check_floor(den_floor, phi_k)
    phi_q, phi_k, v = phi_q.astype(_f32), phi_k.astype(_f32), v.astype(_f32)
    phi_k = apply_key_mask(phi_k, mask)
    ns = masked_log_scale(key_log_scale, mask, phi_k.shape[:3]).transpose(0, 2, 1)  # [B, H, T]
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
    phi_q, phi_k, mass = split_mass(phi_q, phi_k, den_floor)
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
    check_floor(den_floor, phi_k)
    phi_q, phi_k = phi_q.astype(_f32), apply_key_mask(phi_k.astype(_f32), mask)
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
    block_size: int = NONCAUSAL_BLOCK,
    **config,
):
    """A feature-map mechanism's attention from its `FeatureMap` (inputs already checked).

    A token-wise map computes its features inside the scans: chunk by chunk when causal
    (`causal_fused`), and block by block (`block_size` tokens) when non-causal over more
    than two blocks with features wider than the head (M > d: they are then the pass's
    largest arrays; `noncausal_fused`). Otherwise the core gets the whole sequence's
    features (`attend`). Measured: the block-by-block pass at T = 2k-16k ran faster for
    performer, rfa and the flexformers (forward and forward+backward), and slower for
    linear_elu (M = d), and below 2 blocks (docs/performance.md)."""
    params = fmap.resolve(params, rng, deterministic=deterministic, **config)
    if fmap.token_wise and not quadratic:
        floor = fmap.den_floor(**config)
        if causal:
            out = causal_fused(fmap, params, q, k, v, mask, chunk_size, floor, config)
            return out.astype(q.dtype)
        if max(q.shape[1], k.shape[1]) > 2 * block_size and fused_is_wide(fmap, params, k, config):
            out = noncausal_fused(fmap, params, q, k, v, mask, block_size, floor, config)
            return out.astype(q.dtype)
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


def fused_is_wide(fmap, params, k, config) -> bool:
    """Whether the map's key features are wider than the head (M > d), from their shape."""
    phi = jax.eval_shape(lambda x: fmap.key(x, params, **config).phi, k[:, :1])
    return phi.shape[-1] > k.shape[-1]


def noncausal_fused(fmap, params, q, k, v, mask, block_size, den_floor, config, combine=None):
    """Non-causal `linear_attention` of a token-wise `FeatureMap` with its features computed
    block by block inside two scans: one over the key blocks (`_fused_key_sums`), then one
    over the query blocks, each read out from the keys' sums (`read_out_heads_first`).
    Each block's features are recomputed in the backward pass (`jax.checkpoint`), so
    neither pass holds the ``[B, T, H, M]`` features of the whole sequence, only one
    block's, in cache: at T = 4k and 16k the forward and forward+backward ran faster than
    from the whole sequence's features (docs/performance.md). Equal to
    ``linear_attention(fmap.query(q), fmap.key(k).phi, v)`` to rounding (tested for every
    token-wise map); ``[B, Tq, H, Dv]`` float32. `combine`: ``(s, z, zm, c) -> (s, z, zm)``
    applied to the keys' sums before the queries read them (the sequence-parallel pass
    adds the other devices' there)."""
    s, z, zm, c = _fused_key_sums(fmap, params, k, v, mask, block_size, den_floor, config)
    if combine is not None:
        s, z, zm = combine(s, z, zm, c)
    config, channel = mass_channel_config(fmap, config, den_floor)

    # the backward pass recomputes a block's features, never stores them (no CSE to prevent
    # inside a scan)
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def query_block(s, z, zm, qx):
        pq = jnp.swapaxes(fmap.query(qx, params, **config).astype(_f32), 1, 2)  # heads first
        pq = pq[..., :-1] if channel else pq
        mass = zm if den_floor else None
        return read_out_heads_first(pq, s, z, mass, DENOMINATOR_EPS, den_floor)

    b, tq, h = q.shape[:3]
    c, n, pad = chunking(tq, block_size)
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)), mode="edge") if pad else q
    qc = jnp.moveaxis(qp.reshape(b, n, c, *q.shape[2:]), 1, 0)  # [n, B, c, H, d]
    _, out = lax.scan(lambda _, qx: (None, query_block(s, z, zm, qx)), None, qc)
    return jnp.moveaxis(out, 0, 1).reshape(b, n * c, h, -1)[:, :tq]


def _fused_key_sums(fmap, params, k, v, mask, block_size, den_floor, config):
    """The non-causal key sums of a token-wise `FeatureMap`, its features computed block by
    block in a scan: ``(s [B, H, M, Dv], z [B, H, M], zm [B, H], c [B, H])`` with ``s =
    sum_j exp(n_j - c) phi(k_j) v_j^T`` (z likewise, zm the mass channel's sum, 0 without a
    floor) over the unmasked keys, c the max of their log-scales n_j (detached), kept as a
    running max over the blocks (as `combine_states`)."""
    vc, keepc, kc = token_chunks(block_size, mask, v, k)
    config, channel = mass_channel_config(fmap, config, den_floor)

    @functools.partial(jax.checkpoint, prevent_cse=False)  # as in `noncausal_fused`
    def key_block(vx, keepx, kx):
        """One block's ``(s, z, zm, c)``."""
        keys = fmap.key(kx, params, **config)
        check_no_decay(keys.log_decay)
        # heads first [B, H, c, M] (cancels the map's own swap)
        pk = jnp.swapaxes(keys.phi.astype(_f32), 1, 2)
        pk, mass = split_key_mass(pk, den_floor, channel)
        ns = masked_log_scale(keys.log_scale, keepx, (kx.shape[0], kx.shape[1], pk.shape[1]))
        ns = jnp.swapaxes(ns, 1, 2)  # [B, H, c]
        top = lax.stop_gradient(jnp.max(ns, axis=-1))
        # The key weights, 0 at masked keys, go on v and z (c wide), not on phi (M wide).
        w = jnp.where(keepx[:, None, :], jnp.exp(ns - top[..., None]), 0.0)
        s = jnp.einsum("bhcm,bchd->bhmd", pk, scale_rows(vx.astype(_f32), jnp.swapaxes(w, 1, 2)))
        z = jnp.einsum("bhcm,bhc->bhm", pk, w)
        zm = jnp.zeros_like(top) if mass is None else jnp.sum(mass * w, axis=-1)
        return s, z, zm, top

    def key_step(carry, x):
        s, z, zm, c = carry
        s_b, z_b, zm_b, c_b = key_block(*x)
        c_new = jnp.maximum(c, c_b)
        a, b = jnp.exp(c - c_new), jnp.exp(c_b - c_new)
        s = s * a[..., None, None] + s_b * b[..., None, None]
        return (s, z * a[..., None] + z_b * b[..., None], zm * a + zm_b * b, c_new), None

    shapes = jax.eval_shape(key_block, *(x[0] for x in (vc, keepc, kc)))
    init = tuple(jnp.zeros(x.shape, _f32) for x in shapes[:3])
    init += (jnp.full(shapes[3].shape, NEG_LOG_SCALE, _f32),)
    return lax.scan(key_step, init, (vc, keepc, kc))[0]
