"""The shared linear-attention core.

Every feature-map mechanism computes, per head,

    out_i = phi(q_i)^T S / phi(q_i)^T z,   S = sum_j phi(k_j) v_j^T,  z = sum_j phi(k_j)

with the sums over unmasked keys (and j <= i when causal). Feature maps give
``phi_q: [B, Tq, H, M]`` and ``phi_k: [B, Tk, H, M]``; this module turns them
into ``[B, Tq, H, Dv]`` outputs:

* `linear_attention`: non-causal as two einsums, causal as chunked prefix sums
  (quadratic inside a chunk, a `lax.scan` over chunk states across chunks),
  with an optional per-token decay (the gated recurrence of RFA).
* `quadratic_reference`: the naive masked quadratic form of the same features,
  ``(phi(Q) phi(K)^T * tril) V / rowsum``: the oracle the fast paths are
  tested against.

Accumulation is float32 whatever the input dtype. Denominators are guarded by
`guard_denominator`, so a query whose keys are all masked returns zeros.

Relative denominator floor (``den_floor = gamma > 0``). Features that can be negative
(trigonometric random features) give denominators that can cancel to near zero while the
terms they sum are not small: the normalised weights of such a row have an l1 norm far
above 1 and the output is a large multiple of v. Given the key-mass channel (the last
feature column: 0 for queries and ``|phi(k_j)|`` for keys, `mass_channel`), every path
also accumulates ``m_i = |phi(q_i)| sum_j w_ij |phi(k_j)|`` (same weights w_ij: mask,
causality, decay, key scale), which bounds ``|den_i| <= m_i`` (Cauchy-Schwarz), and
raises ``|den_i|`` to at least ``gamma m_i`` keeping its sign. The l1 norm of every
normalised weight row is then at most ``1 / gamma``; rows with ``|den_i| >= gamma m_i`` are
unchanged bit for bit.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

#: Denominators with ``|r| <= DENOMINATOR_EPS`` are pushed away from zero.
DENOMINATOR_EPS = 1e-6

_f32 = jnp.float32
#: Added under the square roots of feature norms: an all-zero feature row gets a finite
#: (zero) gradient instead of NaN.
_TINY_SQ = 1e-30


def guard_denominator(den, eps: float = DENOMINATOR_EPS, floor=None):
    """Pushes ``|den| <= eps`` away from zero: ``den + 2 eps sign(den)`` (sign(0) := +1).

    This is the Performer sin/cos variant's guard: it leaves every well-scaled
    denominator unchanged, works for features that can be negative (trigonometric
    random features), and makes an all-zero row (every key masked) divide its
    zero numerator by ``2 eps`` instead of 0. With `floor` (an array broadcasting
    against `den`, >= 0; the relative floor of the module docstring) ``|den|`` is first
    raised to at least `floor`, keeping its sign.
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
    extra = (
        jnp.zeros_like(phi[..., :1])
        if is_query
        else jnp.sqrt(jnp.sum(phi * phi, axis=-1, keepdims=True) + _TINY_SQ)
    )
    return jnp.concatenate([phi, extra], axis=-1)


def denominator_floor(phi_q, mass, den_floor):
    """The relative floor ``gamma |phi(q_i)| mass_i`` of `guard_denominator` (None when
    `den_floor` is 0); `phi_q` ``[..., M]`` in any layout (``[B, Tq, H, M]``, or heads first
    inside the core), `mass` broadcasting against its leading axes (the mass channel summed
    under the denominator's weights)."""
    if not den_floor:
        return None
    return den_floor * jnp.sqrt(jnp.sum(phi_q * phi_q, axis=-1) + _TINY_SQ) * mass


def _append_ones(v):
    """``[v | 1]``: `v` ``[..., D]`` with a column of ones appended (``[..., D + 1]``), so
    that one product with the key features gives both ``sum phi(k) v^T`` and ``sum phi(k)``."""
    return jnp.concatenate([v, jnp.ones_like(v[..., :1])], axis=-1)


def heads_last(x):
    """``[B, H, T, ...] -> [B, T, H, ...]``: the layout the core takes. A feature map that
    computes heads first (its projection then writes each head's features contiguously)
    returns them through this; the core's own swap back to heads first cancels it."""
    return jnp.swapaxes(x, 1, 2)


def _split_last(x):
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
    pq = jnp.swapaxes(phi_q, 1, 2)
    num = jnp.einsum("bhtm,bhmd->bhtd", pq, s)
    den = jnp.einsum("bhtm,bhm->bht", pq, z)
    floor = None if mass is None else denominator_floor(pq, mass[..., None], den_floor)
    return jnp.swapaxes(num / guard_denominator(den, eps, floor)[..., None], 1, 2)


def _split_mass(phi_q, phi_k, den_floor):
    """``(phi_q, phi_k, mass)``: the features without the mass channel and the channel
    ``[B, Tk, H]`` (None without a floor). The main sums then run on exactly the features
    of the unfloored call, so rows above the floor come out bit for bit the same."""
    if not den_floor:
        return phi_q, phi_k, None
    return (phi_q[..., :-1], *_split_last(phi_k))


def _check_floor(den_floor, phi_k):
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


def _check_one_key_weighting(log_decay, key_log_scale):
    if log_decay is not None and key_log_scale is not None:
        raise ValueError("linear_attention: pass log_decay or key_log_scale, not both")


def _chunking(t: int, chunk_size: int):
    """``(c, n, pad)``: the chunk length (at most `t`), the number of chunks and the padding
    that makes ``n * c`` tokens."""
    c = min(chunk_size, t)
    n = -(-t // c)
    return c, n, n * c - t


def _apply_key_mask(phi_k, mask):
    if mask is None:
        return phi_k
    return phi_k * mask[:, :, None, None].astype(phi_k.dtype)


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
        phi_q, phi_k, mass = _split_mass(phi_q, phi_k, den_floor)
        wk = jnp.exp(ns - lax.stop_gradient(jnp.max(ns, axis=1, keepdims=True)))  # [B, Tk, H]
        # the key weights go on v (Dv wide), not on phi_k (M wide); heads first as in
        # `read_out`
        pk = jnp.swapaxes(phi_k, 1, 2)  # [B, H, Tk, M]
        kv = jnp.einsum("bhtm,bthd->bhmd", pk, v * wk[..., None])
        z = jnp.einsum("bhtm,bth->bhm", pk, wk)
        key_mass = None if mass is None else jnp.sum(mass * wk, axis=1)  # [B, H]
        return read_out(phi_q, kv, z, key_mass, eps=eps, den_floor=den_floor)
    return _causal_chunked(phi_q, phi_k, v, chunk_size, log_decay, ns, eps, den_floor=den_floor)[0]


def causal_linear_attention_from(
    initial_state,
    phi_q,
    phi_k,
    v,
    *,
    mask=None,
    chunk_size: int = 64,
    log_decay=None,
    key_log_scale=None,
    eps: float = DENOMINATOR_EPS,
    den_floor: float = 0.0,
):
    """Causal `linear_attention` continuing from `initial_state` (a `RecurrentState` of
    the keys that precede this block, e.g. on earlier devices); returns ``(out, state)``
    with the state after the block's keys. With an empty initial state
    (`recurrent_init`) the output equals ``linear_attention(..., causal=True)``.
    """
    _check_floor(den_floor, phi_k)
    phi_q, phi_k, v = phi_q.astype(_f32), phi_k.astype(_f32), v.astype(_f32)
    phi_k = _apply_key_mask(phi_k, mask)
    ns = _masked_log_scale(key_log_scale, mask, phi_k.shape[:3])
    return _causal_chunked(
        phi_q, phi_k, v, chunk_size, log_decay, ns, eps, initial_state, den_floor=den_floor
    )


def block_state(phi_k, v, *, mask=None, log_decay=None, key_log_scale=None):
    """The `RecurrentState` of one block of keys alone (from an empty state), in one pass:
    ``s = sum_j exp(G - G_j + n_j - c) phi(k_j) v_j^T`` with ``G_j`` the cumulative log decay
    up to j, ``G`` its total and ``c`` the max of the key log-scales (detached)."""
    phi_k, v = _apply_key_mask(phi_k.astype(_f32), mask), v.astype(_f32)
    ns = _masked_log_scale(key_log_scale, mask, phi_k.shape[:3])
    c = lax.stop_gradient(jnp.max(ns, axis=1))  # [B, H]
    logw = ns - c[:, None]
    if log_decay is not None:
        g = jnp.cumsum(log_decay.astype(_f32), axis=1)
        logw = logw + g[:, -1:] - g
    w = jnp.exp(logw)[..., None]
    return RecurrentState(
        jnp.einsum("bthm,bthd->bhmd", phi_k * w, v), jnp.sum(phi_k * w, axis=1), c
    )


def combine_states(first: RecurrentState, second: RecurrentState, second_log_decay=None):
    """The state of two consecutive blocks of keys from each block's own state
    (`block_state`): ``first`` decayed by the second block's total log decay
    ``[B, H]`` (None: no decay), then ``second``, under the larger stabiliser."""
    g = 0.0 if second_log_decay is None else second_log_decay
    c = jnp.maximum(first.c, second.c)
    a = jnp.exp(g + first.c - c)
    b = jnp.exp(second.c - c)
    return RecurrentState(
        first.s * a[..., None, None] + second.s * b[..., None, None],
        first.z * a[..., None] + second.z * b[..., None],
        c,
    )


#: Log-scale of masked (and padded) keys: finite, so differences never give NaN.
_NEG = -1e30


def _masked_log_scale(key_log_scale, mask, shape):
    """``[B, Tk, H]`` float32 log-scales, `_NEG` at masked keys (0 when not given)."""
    ns = jnp.zeros(shape, _f32) if key_log_scale is None else key_log_scale.astype(_f32)
    if mask is not None:
        ns = jnp.where(mask[:, :, None], ns, _NEG)
    return ns


def _causal_chunked(
    phi_q, phi_k, v, chunk_size, log_decay, ns, eps, initial_state=None, *, den_floor=0.0
):
    """``(out [B, T, H, Dv], final RecurrentState)``; `initial_state` is the state of the
    keys before this sequence (default: none). With `den_floor` the mass channel is
    carried apart (``zm``) and the state's z keeps it as its last column; the state's s
    row of that channel is returned as zeros (queries, 0 there, never read it)."""
    phi_q, phi_k, mass = _split_mass(phi_q, phi_k, den_floor)
    if mass is None:
        mass = jnp.zeros(phi_k.shape[:3], _f32)  # carried, never read
    b, t, h, m = phi_q.shape
    c, n, pad = _chunking(t, chunk_size)
    if log_decay is None:
        log_decay = jnp.zeros((b, t, h), _f32)
    log_decay = log_decay.astype(_f32)
    if pad:
        # Padded keys have zero features and zero decay; padded queries are dropped.
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        phi_q, phi_k, v = (jnp.pad(x, widths) for x in (phi_q, phi_k, v))
        log_decay, mass = jnp.pad(log_decay, widths[:3]), jnp.pad(mass, widths[:3])
        ns = jnp.pad(ns, widths[:3], constant_values=_NEG)

    def chunks(x):  # [B, n*c, H, ...] -> [n, B, H, c, ...] (heads first)
        x = jnp.swapaxes(x, 1, 2)
        return jnp.moveaxis(x.reshape(b, h, n, c, *x.shape[3:]), 2, 0)

    xs = (phi_q, phi_k, _append_ones(v), log_decay, ns, mass)  # padded keys: phi_k = 0
    return _chunk_scan(lambda x: x, tuple(map(chunks, xs)), t, eps, initial_state, den_floor)


def _causal_fused(fmap, params, q, k, v, mask, chunk_size, den_floor, config):
    """Causal `linear_attention` of a token-wise `FeatureMap` with its features computed
    chunk by chunk inside the scan, so the forward pass never holds the ``[B, T, H, M]``
    features of the whole sequence (one chunk's at a time, in cache). Equal to
    ``linear_attention(fmap.query(q), fmap.key(k).phi, v, causal=True, ...)`` to rounding
    (tested for every token-wise map); ``[B, T, H, Dv]`` float32."""
    b, t = q.shape[:2]
    c, n, pad = _chunking(t, chunk_size)
    keep = key_mask(mask, t, b)
    if pad:
        # Padded tokens repeat the last one (finite features whatever the map) and are
        # masked out as keys; their queries are dropped.
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q, k = (jnp.pad(x, widths, mode="edge") for x in (q, k))
        v, keep = jnp.pad(v, widths), jnp.pad(keep, widths[:2])

    def chunks(x):  # [B, n*c, ...] -> [n, B, c, ...] (token-major, as the feature map takes it)
        return jnp.moveaxis(x.reshape(b, n, c, *x.shape[2:]), 1, 0)

    def prepare(x):
        qc, kc, vc, keepc = x
        keys = fmap.key(kc, params, **config)
        _check_one_key_weighting(keys.log_decay, keys.log_scale)
        pq = fmap.query(qc, params, **config).astype(_f32)
        pk = _apply_key_mask(keys.phi.astype(_f32), keepc)
        pq, pk, mass = _split_mass(pq, pk, den_floor)
        zeros = jnp.zeros(pk.shape[:3], _f32)
        ns = _masked_log_scale(keys.log_scale, keepc, pk.shape[:3])
        ld = zeros if keys.log_decay is None else keys.log_decay.astype(_f32)
        mass = zeros if mass is None else mass
        parts = (pq, pk, _append_ones(vc.astype(_f32)), ld, ns, mass)
        return tuple(jnp.swapaxes(p, 1, 2) for p in parts)  # heads first

    xs = tuple(map(chunks, (q, k, v, keep)))
    return _chunk_scan(prepare, xs, t, DENOMINATOR_EPS, None, den_floor)[0]


def _chunk_scan(prepare, xs, t, eps, initial_state, den_floor):
    """The chunked causal recurrence over `xs` (leading axis: the n chunks of length c).

    ``prepare(x)`` maps one chunk of `xs` to its heads-first ``(pq [B, H, c, M],
    pk [B, H, c, M], [v | 1] [B, H, c, Dv + 1], log_decay, ns, mass [B, H, c])``, the keys
    already masked; `t` is the unpadded length. Returns ``(out [B, t, H, Dv],
    RecurrentState)`` as `_causal_chunked`.
    """
    shapes = jax.eval_shape(prepare, jax.tree.map(lambda x: x[0], xs))
    b, h, c, m = shapes[0].shape
    dv = shapes[2].shape[-1] - 1
    tril = jnp.tril(jnp.ones((c, c), bool))

    def step(carry, x):
        # State before this chunk, kept relative to the running key max mp:
        # s = sum_j exp(n_j - mp) phi(k_j) v_j^T  [B, H, M, Dv], z likewise [B, H, M],
        # carried as one sz = [s | z] [B, H, M, Dv + 1] (the values as [v | 1]), so that
        # each product gives a numerator and its denominator together.
        sz, zm, mp = carry
        pq, pk, vc, ld, nc, mc = prepare(x)  # heads first; vc: [v | 1]
        # Cumulative log-decay inside the chunk: G_t = sum_{l <= t} log g_l.
        gc = jnp.cumsum(ld, axis=-1)
        # Running max of the key log-scales up to each position (detached; it cancels).
        cm = lax.stop_gradient(jnp.maximum(mp[..., None], lax.cummax(nc, axis=2)))  # [B, H, c]
        # Intra-chunk weights exp(G_i - G_j + n_j - cm_i) for j <= i (all <= 1).
        logw = gc[..., :, None] - gc[..., None, :] + nc[..., None, :] - cm[..., :, None]
        weight = jnp.where(tril, jnp.exp(jnp.where(tril, logw, 0.0)), 0.0)  # [B, H, c, c]
        scores = jnp.einsum("bhim,bhjm->bhij", pq, pk) * weight
        nd = jnp.einsum("bhij,bhjd->bhid", scores, vc)  # [B, H, c, Dv + 1]
        # Inter-chunk: the carried state decayed to position i by exp(G_i), rescaled to cm_i.
        carry_scale = jnp.exp(gc + mp[..., None] - cm)  # [B, H, c]
        nd = nd + jnp.einsum("bhim,bhmd->bhid", pq * carry_scale[..., None], sz)
        num, den = _split_last(nd)
        floor = None
        if den_floor:  # the mass channel under the same weights
            mass_i = jnp.einsum("bhij,bhj->bhi", weight, mc) + carry_scale * zm[..., None]
            floor = denominator_floor(pq, mass_i, den_floor)
        out = num / guard_denominator(den, eps, floor)[..., None]
        # State after the chunk: old state decayed by exp(G_last), new keys by
        # exp(G_last - G_j), all relative to the new running max.
        g_last, m_new = gc[..., -1], cm[..., -1]  # [B, H]
        w = jnp.exp(g_last[..., None] - gc + nc - m_new[..., None])  # [B, H, c]
        old = jnp.exp(g_last + mp - m_new)
        sz = sz * old[..., None, None] + jnp.einsum("bhjm,bhjd->bhmd", pk, vc * w[..., None])
        zm = zm * old + jnp.sum(mc * w, axis=-1)
        return (sz, zm, m_new), out

    if initial_state is None:
        s0, z0, c0 = recurrent_init(b, h, m, dv)
        zm0 = jnp.zeros((b, h), _f32)
    elif den_floor:
        s0, c0 = initial_state.s[..., :-1, :], initial_state.c
        z0, zm0 = _split_last(initial_state.z)
    else:
        (s0, z0, c0), zm0 = initial_state, jnp.zeros((b, h), _f32)
    sz0 = jnp.concatenate([s0, z0[..., None]], axis=-1)
    (sz, zm, c_last), out = lax.scan(step, (sz0, zm0, c0), xs)  # out [n, B, H, c, Dv]
    s, z = _split_last(sz)
    n = out.shape[0]
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * c, dv).swapaxes(1, 2)
    if den_floor:
        s = jnp.concatenate([s, jnp.zeros_like(s[..., :1, :])], axis=-2)
        z = jnp.concatenate([z, zm[..., None]], axis=-1)
    return out[:, :t], RecurrentState(s, z, c_last)


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


#: pi / 2 in three parts (Cody-Waite): ``k * _PIO2[0]`` and ``k * _PIO2[1]`` are exact in
#: float32 for |x| < ~1e4, so the reduced argument keeps its accuracy there.
_PIO2 = (2 * 0.78515625, 2 * 2.4187564849853515625e-4, 2 * 3.77489497744594108e-8)
#: Minimax polynomials of sin and cos on [-pi/4, pi/4] (Cephes' single-precision sinf/cosf).
_SIN_C = (-1.6666654611e-1, 8.3321608736e-3, -1.9515295891e-4)
_COS_C = (4.166664568298827e-2, -1.388731625493765e-3, 2.443315711809948e-5)


@jax.custom_jvp
def sincos(x):
    """``(sin x, cos x)`` of float32 `x` with one shared range reduction.

    ``x = k pi/2 + r`` with ``|r| <= pi/4``, both from polynomials in r, swapped and negated
    by the quadrant ``k mod 4``. The trigonometric feature maps (flexformer, rfa) need both
    of the same argument; XLA's CPU `cos` and `sin` reduce the argument twice and cost
    about 4x an `exp` together, this costs about one (measured on [1, 4096, 4, 128]).
    Absolute error <= 1e-7 against float64 for |x| < 1e4 (the reduction's exact range;
    beyond it the error grows with |x|: <= 1e-6 at 1e5). Its derivatives are
    ``(cos x, -sin x)`` from the same outputs (a custom JVP: the backward pass costs two
    products).
    """
    x = x.astype(_f32)
    k = jnp.round(x * (2 / math.pi))
    r = ((x - k * _PIO2[0]) - k * _PIO2[1]) - k * _PIO2[2]
    r2 = r * r
    s = r + r * r2 * (_SIN_C[0] + r2 * (_SIN_C[1] + r2 * _SIN_C[2]))
    c = 1.0 - 0.5 * r2 + r2 * r2 * (_COS_C[0] + r2 * (_COS_C[1] + r2 * _COS_C[2]))
    q = k.astype(jnp.int32) & 3  # the quadrant
    odd = (q & 1) == 1
    sin, cos = jnp.where(odd, c, s), jnp.where(odd, s, c)
    return jnp.where(q >= 2, -sin, sin), jnp.where((q == 1) | (q == 2), -cos, cos)


@sincos.defjvp
def _sincos_jvp(primals, tangents):
    # the exact derivatives from the outputs themselves: d sin = cos dx, d cos = -sin dx
    sin, cos = sincos(primals[0])
    dx = tangents[0].astype(_f32)
    return (sin, cos), (cos * dx, -sin * dx)


def scale_inputs(x):
    """``x^ = x d^(-1/4)`` in float32, so ``exp(q^ . k^) = exp(q . k / sqrt(d))``."""
    x = x.astype(_f32)
    return x * x.shape[-1] ** -0.25


# ---------------------------------------------------------------- the feature-map protocol
class KeyFeatures(NamedTuple):
    """What a feature-map mechanism hands the core for its keys (SPEC section 7).

    Attributes:
      phi: ``[B, Tk, H, M]`` float32 key features.
      log_scale: optional ``[B, Tk, H]``: the key features are ``exp(log_scale) phi``
        (`linear_attention`'s ``key_log_scale``; stabilised there by a detached max).
      log_decay: optional ``[B, Tk, H]`` log of a per-token state decay (a gated
        recurrence, causal only; `linear_attention`'s ``log_decay``).
    """

    phi: Any
    log_scale: Any = None
    log_decay: Any = None


def _accepted(fn: Callable, config: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `config` that `fn` takes as keyword-only parameters."""
    names = {p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}
    return {k: v for k, v in config.items() if k in names}


@dataclasses.dataclass(frozen=True)
class FeatureMap:
    """A feature-map mechanism's features, exactly as its `attention` hands them to the core.

    ``la.get(name).feature_map`` (None for mechanisms that are not feature maps). Training
    code (distillation, recurrent decoding, sequence parallelism) goes through this record,
    so a new feature-map mechanism gets all of them by registering one::

        fm = la.get("performer").feature_map
        p = fm.resolve(params, rng, deterministic=False)    # this call's random features
        phi_q = fm.query(q, p)                              # [B, Tq, H, M]
        phi_k, log_scale, log_decay = fm.key(k, p)          # KeyFeatures
        out = core.attend(phi_q, phi_k, v, q.dtype, key_log_scale=log_scale,
                          log_decay=log_decay,
                          den_floor=fm.den_floor())         # == mechanism.attention(...)

    Attributes:
      query_fn: ``(q, params, **config) -> [B, Tq, H, M]`` float32.
      key_fn: ``(k, params, **config) -> KeyFeatures``.
      draw_fn: ``(params, rng, **config) -> params`` with freshly drawn random features
        (the redraw of a stochastic mechanism when ``deterministic=False``), or None.
      floor_fn: ``(**config) -> float``, the relative denominator floor gamma of this map
        (`den_floor`; when > 0 the features carry the key-mass channel, `mass_channel`),
        or None (no floor). Every caller of the core passes it on.
      token_wise: the features of each token depend on that token alone (not on the
        rest of the sequence), so the causal path may compute them chunk by chunk inside
        its scan (`attend_features`), never holding the whole sequence's features in the
        forward pass.
      config: config values (the mechanism's bound config); each function receives the
        keys it declares as keyword-only parameters.
    """

    query_fn: Callable[..., Any]
    key_fn: Callable[..., KeyFeatures]
    draw_fn: Callable[..., Any] | None = None
    floor_fn: Callable[..., float] | None = None
    token_wise: bool = False
    config: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    def bind(self, **config) -> FeatureMap:
        """This feature map with `config` values fixed."""
        return dataclasses.replace(self, config=MappingProxyType({**self.config, **config}))

    def _call(self, fn, *args, **config):
        return fn(*args, **_accepted(fn, {**self.config, **config}))

    def query(self, q, params, **config):
        """Query features ``[B, Tq, H, M]`` float32."""
        return self._call(self.query_fn, q, params, **config)

    def key(self, k, params, **config) -> KeyFeatures:
        """Key features with their log scale and log decay."""
        return KeyFeatures(*self._call(self.key_fn, k, params, **config))

    def den_floor(self, **config) -> float:
        """The relative denominator floor gamma (0.0: none) to pass to the core."""
        return 0.0 if self.floor_fn is None else float(self._call(self.floor_fn, **config))

    def resolve(self, params, rng=None, *, deterministic: bool = False, **config):
        """The params one call uses: `params` itself when deterministic (or when nothing is
        random), else `params` with the random features redrawn from `rng`."""
        if deterministic or self.draw_fn is None:
            return params
        return self._call(self.draw_fn, params, rng, **config)


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


class RecurrentState(NamedTuple):
    """The constant-size state of causal linear attention after t tokens (per head).

    ``s = sum_j D_j exp(n_j - c) phi(k_j) v_j^T`` ``[B, H, M, Dv]`` and ``z`` likewise
    without v ``[B, H, M]``, with D_j the product of the decays after token j and ``c``
    ``[B, H]`` the running max of the key log-scales (the same stabiliser as the chunked
    causal form, so both agree to rounding).
    """

    s: Any
    z: Any
    c: Any


def recurrent_init(batch: int, num_heads: int, num_features: int, value_dim: int):
    """The empty `RecurrentState` (no token seen)."""
    return RecurrentState(
        jnp.zeros((batch, num_heads, num_features, value_dim), _f32),
        jnp.zeros((batch, num_heads, num_features), _f32),
        jnp.full((batch, num_heads), _NEG, _f32),
    )


def recurrent_step(
    state: RecurrentState, phi_q, keys: KeyFeatures, v, eps=DENOMINATOR_EPS, den_floor=0.0
):
    """One token of causal linear attention: ``(out [B, 1, H, Dv] float32, new state)``.

    Args:
      state: `RecurrentState` before this token.
      phi_q: ``[B, 1, H, M]`` the token's query features.
      keys: the token's `KeyFeatures` (``[B, 1, H, M]``, log scale / decay ``[B, 1, H]``).
      v: ``[B, 1, H, Dv]`` its value.
      eps, den_floor: as in `linear_attention`.
    """
    _check_floor(den_floor, keys.phi)
    s, z, c = state
    b = keys.phi[:, 0].astype(_f32)  # [B, H, M]
    n = jnp.zeros_like(c) if keys.log_scale is None else keys.log_scale[:, 0].astype(_f32)
    g = jnp.ones_like(c) if keys.log_decay is None else jnp.exp(keys.log_decay[:, 0])
    c_new = jnp.maximum(c, n)  # [B, H]
    old = g * jnp.exp(c - c_new)  # rescale to the new stabiliser, then decay
    kf = jnp.exp(n - c_new)[..., None] * b  # [B, H, M]
    v = v[:, 0].astype(_f32)
    s = s * old[..., None, None] + kf[..., None] * v[:, :, None, :]
    z = z * old[..., None] + kf
    mass = z[..., -1] if den_floor else None  # the query's mass column is 0: dots unchanged
    out = read_out(phi_q.astype(_f32), s, z, mass, eps=eps, den_floor=den_floor)
    return out, RecurrentState(s, z, c_new)


__all__ = [
    "DENOMINATOR_EPS",
    "FeatureMap",
    "KeyFeatures",
    "RecurrentState",
    "attend_features",
    "block_state",
    "causal_linear_attention_from",
    "combine_states",
    "recurrent_init",
    "recurrent_step",
    "guard_denominator",
    "mass_channel",
    "denominator_floor",
    "read_out",
    "heads_last",
    "masked_max",
    "key_mask",
    "linear_attention",
    "quadratic_reference",
    "attend",
    "normalized_weights",
    "scale_inputs",
    "sincos",
]
