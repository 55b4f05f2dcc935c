"""The causal form of linear attention: chunked prefix sums (quadratic inside a chunk, the
chunk states carried across chunks), from precomputed features
(`causal_linear_attention_from`, `causal_chunked`) or with a token-wise feature map's
features computed chunk by chunk inside the scan (`causal_fused`); both run `_chunks`,
which carries the states by a `lax.scan` (`_chunk_scan`) or by a parallel prefix over the
chunks (`_chunk_parallel`), as `CAUSAL_FORM` says.
`fused_block_state` is the key summary (`block_state`) of such a map, likewise chunk by
chunk: the sequence-parallel causal pass (`linattn_jax.parallel`) gathers it across devices
and starts `causal_fused` from the devices' before it.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax import lax

from linattn_jax.core.common import (
    DENOMINATOR_EPS,
    NEG_LOG_SCALE,
    append_ones,
    apply_key_mask,
    check_floor,
    check_one_key_weighting,
    denominator_floor,
    divide_rows,
    guard_denominator,
    key_mask,
    masked_log_scale,
    scale_rows,
    split_last,
    split_mass,
)
from linattn_jax.core.recurrent import RecurrentState, block_state, combine_states, recurrent_init

_f32 = jnp.float32

#: How the causal form carries its chunk states: ``"scan"`` (`_chunk_scan`: a `lax.scan`,
#: one chunk after another, features computed inside it: the least memory, and on CPU the
#: fastest), ``"parallel"`` (`_chunk_parallel`: every chunk at once, the states before each
#: by a parallel prefix, log depth in the number of chunks: for accelerators, where the
#: scan's small sequential steps are latency-bound (on an H200, 4-15x faster than the scan:
#: docs/performance.md, the H200 run); it holds every chunk's features and
#: state, ``T / chunk_size x B x H x M x (Dv + 1)`` floats, where the scan holds one: set
#: ``"scan"`` when that does not fit) or ``"auto"``: the scan on CPU, the parallel form on
#: any other backend. Both give the same values to rounding. Read when a function is traced
#: (a jitted function keeps the form it was traced with). Its default comes from the
#: environment variable ``LINATTN_CAUSAL_FORM`` (unset: ``"auto"``), so that a benchmark's
#: subprocesses share it.
CAUSAL_FORM = os.environ.get("LINATTN_CAUSAL_FORM", "auto")
_FORMS = ("auto", "scan", "parallel")


def causal_form() -> str:
    """The form `CAUSAL_FORM` picks on the default backend: ``"scan"`` or ``"parallel"``."""
    if CAUSAL_FORM not in _FORMS:
        raise ValueError(
            f"core.causal.CAUSAL_FORM (default: env LINATTN_CAUSAL_FORM) must be one of "
            f"{_FORMS}, got {CAUSAL_FORM!r}"
        )
    if CAUSAL_FORM == "auto":
        return "scan" if jax.default_backend() == "cpu" else "parallel"
    return CAUSAL_FORM


def _chunks(prepare, xs, t, eps, initial_state, den_floor):
    """`_chunk_scan` or `_chunk_parallel` (`causal_form`), same arguments and result."""
    run = _chunk_scan if causal_form() == "scan" else _chunk_parallel
    return run(prepare, xs, t, eps, initial_state, den_floor)


def chunking(t: int, chunk_size: int):
    """``(c, n, pad)``: the chunk length (at most `t`), the number of chunks and the padding
    that makes ``n * c`` tokens."""
    c = min(chunk_size, t)
    n = -(-t // c)
    return c, n, n * c - t


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
    check_floor(den_floor, phi_k)
    phi_q, phi_k, v = phi_q.astype(_f32), phi_k.astype(_f32), v.astype(_f32)
    phi_k = apply_key_mask(phi_k, mask)
    ns = masked_log_scale(key_log_scale, mask, phi_k.shape[:3])
    return causal_chunked(
        phi_q, phi_k, v, chunk_size, log_decay, ns, eps, initial_state, den_floor=den_floor
    )


def causal_chunked(
    phi_q, phi_k, v, chunk_size, log_decay, ns, eps, initial_state=None, *, den_floor=0.0
):
    """``(out [B, T, H, Dv], final RecurrentState)``; `initial_state` is the state of the
    keys before this sequence (default: none). With `den_floor` the mass channel is
    carried apart (``zm``) and the state's z keeps it as its last column; the state's s
    row of that channel is returned as zeros (queries, 0 there, never read it)."""
    phi_q, phi_k, mass = split_mass(phi_q, phi_k, den_floor)
    if mass is None:
        mass = jnp.zeros(phi_k.shape[:3], _f32)  # carried, never read
    b, t, h, m = phi_q.shape
    c, n, pad = chunking(t, chunk_size)
    if log_decay is None:
        log_decay = jnp.zeros((b, t, h), _f32)
    log_decay = log_decay.astype(_f32)
    if pad:
        # Padded keys have zero features and zero decay; padded queries are dropped.
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        phi_q, phi_k, v = (jnp.pad(x, widths) for x in (phi_q, phi_k, v))
        log_decay, mass = jnp.pad(log_decay, widths[:3]), jnp.pad(mass, widths[:3])
        ns = jnp.pad(ns, widths[:3], constant_values=NEG_LOG_SCALE)

    def chunks(x):  # [B, n*c, H, ...] -> [n, B, H, c, ...] (heads first)
        x = jnp.swapaxes(x, 1, 2)
        return jnp.moveaxis(x.reshape(b, h, n, c, *x.shape[3:]), 2, 0)

    xs = (phi_q, phi_k, append_ones(v), log_decay, ns, mass)  # padded keys: phi_k = 0
    return _chunks(lambda x: x, tuple(map(chunks, xs)), t, eps, initial_state, den_floor)


def token_chunks(chunk_size, mask, v, *xs):
    """``(v, keep, *xs)`` of ``[B, T, ...]`` tokens in the n chunks of `chunking`, as
    ``[n, B, c, ...]`` (token-major, as a feature map takes them), `keep` the ``[B, T]`` key
    mask (all True when `mask` is None). Padded tokens repeat the last one in `xs` (finite
    features whatever the map), have zero values and are masked out as keys."""
    b, t = v.shape[:2]
    c, n, pad = chunking(t, chunk_size)
    keep = key_mask(mask, t, b)
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        xs = tuple(jnp.pad(x, widths, mode="edge") for x in xs)
        v, keep = jnp.pad(v, widths), jnp.pad(keep, widths[:2])

    def chunks(x):  # [B, n*c, ...] -> [n, B, c, ...]
        return jnp.moveaxis(x.reshape(b, n, c, *x.shape[2:]), 1, 0)

    return tuple(map(chunks, (v, keep, *xs)))


def check_no_decay(log_decay):
    """Raises ValueError when a decay is given to the non-causal form."""
    if log_decay is not None:
        raise ValueError("linear_attention: log_decay needs causal=True")


def _chunk_keys(fmap, params, kc, keepc, config):
    """One chunk's `KeyFeatures` with the key mask applied: ``(phi, ns, log_decay)``, ns the
    masked log-scales (`masked_log_scale`), log_decay None without a decay."""
    keys = fmap.key(kc, params, **config)
    check_one_key_weighting(keys.log_decay, keys.log_scale)
    phi = apply_key_mask(keys.phi.astype(_f32), keepc)
    ns = masked_log_scale(keys.log_scale, keepc, phi.shape[:3])
    return phi, ns, keys.log_decay


def mass_channel_config(fmap, config, den_floor):
    """``(config, channel)`` for the fused passes' calls of `fmap`: with a floor whose
    value comes from the config's ``den_floor`` (`fmap.den_floor` reads 0 at
    ``den_floor=0``), the config with ``den_floor=0``, so that the map returns its features
    without the mass channel and the pass computes the channel's values, ``|phi(k)|``
    (`key_mass`), from the features themselves (``channel=False``): the appended channel
    costs XLA a concatenated copy of the features and, in the backward, a pad of their
    cotangents (flexformer's forward at T = 4k took 1.3-1.8x performer's time with it and
    0.8-1.1x without, docs/performance.md). Otherwise `config` as given, the channel (if
    any) in the features' last column (``channel=den_floor > 0``)."""
    if den_floor:
        plain = {**config, "den_floor": 0.0}
        if fmap.den_floor(**plain) == 0.0:
            return plain, False
    return config, bool(den_floor)


def causal_fused(fmap, params, q, k, v, mask, chunk_size, den_floor, config, initial_state=None):
    """Causal `linear_attention` of a token-wise `FeatureMap` with its features computed
    chunk by chunk inside the scan, so the forward pass never holds the ``[B, T, H, M]``
    features of the whole sequence (one chunk's at a time, in cache; the parallel form of
    `CAUSAL_FORM` computes every chunk's at once). Equal to
    ``linear_attention(fmap.query(q), fmap.key(k).phi, v, causal=True, ...)`` to rounding
    (tested for every token-wise map); ``[B, T, H, Dv]`` float32. `initial_state`: the
    `RecurrentState` of the keys before this sequence (as `causal_linear_attention_from`;
    the sequence-parallel path passes the devices' before it, `fused_block_state`)."""
    t = q.shape[1]
    config, channel = mass_channel_config(fmap, config, den_floor)

    def prepare(x):
        vc, keepc, qc, kc = x
        keys = fmap.key(kc, params, **config)
        check_one_key_weighting(keys.log_decay, keys.log_scale)
        # heads first before a mass channel is split off: a feature map's own swap
        # (`heads_last`) then cancels and the split is free
        pq = jnp.swapaxes(fmap.query(qc, params, **config).astype(_f32), 1, 2)
        pk = jnp.swapaxes(keys.phi.astype(_f32), 1, 2) * keepc[:, None, :, None].astype(_f32)
        pq, pk, mass = split_mass(pq, pk, den_floor, channel)  # mass [B, H, c]
        bhc = pk.shape[:3]
        ns = masked_log_scale(keys.log_scale, keepc, (bhc[0], bhc[2], bhc[1]))
        ns = jnp.swapaxes(ns, 1, 2)
        zeros = jnp.zeros(bhc, _f32)
        ld = zeros if keys.log_decay is None else jnp.swapaxes(keys.log_decay.astype(_f32), 1, 2)
        mass = zeros if mass is None else mass
        return (pq, pk, jnp.swapaxes(append_ones(vc.astype(_f32)), 1, 2), ld, ns, mass)

    xs = token_chunks(chunk_size, mask, v, q, k)
    return _chunks(prepare, xs, t, DENOMINATOR_EPS, initial_state, den_floor)[0]


def fused_block_state(fmap, params, k, v, mask, chunk_size, config):
    """`block_state` of a token-wise `FeatureMap`'s keys with their features computed chunk
    by chunk inside a scan (never the ``[B, T, H, M]`` features of the whole block): each
    chunk's state folded into the running one by `combine_states` (decays and key
    log-scales exact). Returns ``(RecurrentState, total log decay [B, H])``; with a
    den_floor map its features' mass channel is the state's last feature, as in
    `block_state` of ``fmap.key(k).phi``."""
    t = k.shape[1]
    vc, keepc, kc = token_chunks(chunk_size, mask, v, k)
    real = (jnp.arange(vc.shape[0] * vc.shape[2]) < t).reshape(vc.shape[0], vc.shape[2])

    @jax.checkpoint  # the backward pass recomputes a chunk's features, never stores them
    def chunk_state(vx, keepx, kx, realx):
        phi, ns, ld = _chunk_keys(fmap, params, kx, keepx, config)
        ld = jnp.zeros(phi.shape[:3], _f32) if ld is None else ld.astype(_f32)
        ld = jnp.where(realx[None, :, None], ld, 0.0)  # padded tokens do not decay
        return block_state(phi, vx, log_decay=ld, key_log_scale=ns), jnp.sum(ld, axis=1)

    def step(carry, x):
        state, total = carry
        block, g = chunk_state(*x)  # g: the chunk's total log decay [B, H]
        return (combine_states(state, block, g), total + g), None

    b, h = v.shape[0], v.shape[2]
    m = jax.eval_shape(lambda kx: fmap.key(kx, params, **config).phi, kc[0]).shape[-1]
    init = (recurrent_init(b, h, m, v.shape[-1]), jnp.zeros((b, h), _f32))
    return lax.scan(step, init, (vc, keepc, kc, real))[0]


def _chunk_output(carry, prepared, tril, eps, den_floor):
    """One chunk's output ``[B, H, c, Dv]``: the chunk's keys up to each query (a masked
    quadratic form) plus the `carry` ``(sz, zm, mp)`` of the keys before the chunk
    (`_chunk_scan`)."""
    sz, zm, mp = carry
    pq, pk, vc, ld, nc, mc = prepared  # heads first; vc: [v | 1]
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
    num, den = split_last(nd)
    floor = None
    if den_floor:  # the mass channel under the same weights
        mass_i = jnp.einsum("bhij,bhj->bhi", weight, mc) + carry_scale * zm[..., None]
        floor = denominator_floor(pq, mass_i, den_floor)
    return divide_rows(num, guard_denominator(den, eps, floor))


def _chunk_update(carry, prepared):
    """The carry ``(sz, zm, mp)`` after one chunk's keys (`_chunk_scan`): the old state
    decayed by ``exp(G_last)``, the chunk's keys by ``exp(G_last - G_j)``, all relative to
    the new running max of the key log-scales."""
    sz, zm, mp = carry
    _, pk, vc, ld, nc, mc = prepared
    gc = jnp.cumsum(ld, axis=-1)
    g_last = gc[..., -1]  # [B, H]
    m_new = lax.stop_gradient(jnp.maximum(mp, jnp.max(nc, axis=-1)))
    w = jnp.exp(g_last[..., None] - gc + nc - m_new[..., None])  # [B, H, c]
    old = jnp.exp(g_last + mp - m_new)
    sz = sz * old[..., None, None] + jnp.einsum("bhjm,bhjd->bhmd", pk, scale_rows(vc, w))
    zm = zm * old + jnp.sum(mc * w, axis=-1)
    return sz, zm, m_new


def _initial_carry(initial_state, b, h, m, dv, den_floor):
    """``(sz, zm, mp)`` of `initial_state` (None: no keys before), `_chunk_scan`'s carry."""
    if initial_state is None:
        s0, z0, c0 = recurrent_init(b, h, m, dv)
        zm0 = jnp.zeros((b, h), _f32)
    elif den_floor:
        s0, c0 = initial_state.s[..., :-1, :], initial_state.c
        z0, zm0 = split_last(initial_state.z)
    else:
        (s0, z0, c0), zm0 = initial_state, jnp.zeros((b, h), _f32)
    return jnp.concatenate([s0, z0[..., None]], axis=-1), zm0, c0


def _final_state(carry, den_floor):
    """The `RecurrentState` of the final carry (the mass channel as z's last column)."""
    sz, zm, c_last = carry
    s, z = split_last(sz)
    if den_floor:
        s = jnp.concatenate([s, jnp.zeros_like(s[..., :1, :])], axis=-2)
        z = jnp.concatenate([z, zm[..., None]], axis=-1)
    return RecurrentState(s, z, c_last)


def _combine_carries(first, second):
    """The carry of two consecutive runs of chunks from each one's own carry, for
    `lax.associative_scan` (leading axis batched): `combine_states` of the two, with the
    mass channel zm in the z slot (it is scaled as z is). A carry here is ``(sz, zm, mp,
    g)``, g the total log decay of its chunks."""
    (sz1, zm1, m1, g1), (sz2, zm2, m2, g2) = first, second
    sz, zm, m = combine_states(
        RecurrentState(sz1, zm1[..., None], m1), RecurrentState(sz2, zm2[..., None], m2), g2
    )
    return sz, zm[..., 0], m, g1 + g2


def _chunk_parallel(prepare, xs, t, eps, initial_state, den_floor):
    """`_chunk_scan`'s result with the chunks taken side by side instead of one after
    another: each chunk's own carry from an empty one (`_chunk_update`), the carries before
    every chunk by a parallel prefix (`lax.associative_scan` of `_combine_carries`), then
    every chunk's output at once (`_chunk_output`). Log depth in the number of chunks
    instead of a sequential loop (for accelerators, where the loop's small steps are
    latency-bound), at the memory of every chunk's features and carry."""
    prepared = jax.vmap(prepare)(xs)
    n, b, h, c, m = prepared[0].shape
    dv = prepared[2].shape[-1] - 1
    tril = jnp.tril(jnp.ones((c, c), bool))
    empty = _initial_carry(None, b, h, m, dv, den_floor)
    own = jax.vmap(lambda p: _chunk_update(empty, p))(prepared)  # [n, ...]
    total = jnp.sum(prepared[3], axis=-1)  # each chunk's total log decay [n, B, H]
    first = (*_initial_carry(initial_state, b, h, m, dv, den_floor), jnp.zeros((b, h), _f32))
    carries = jax.tree.map(lambda x0, xs_: jnp.concatenate([x0[None], xs_]), first, (*own, total))
    prefix = lax.associative_scan(_combine_carries, carries)  # [n + 1, ...]: after 0..n chunks
    before = jax.tree.map(lambda x: x[:-1], prefix[:3])
    out = jax.vmap(lambda cy, p: _chunk_output(cy, p, tril, eps, den_floor))(before, prepared)
    return _unchunk(out, t), _final_state(jax.tree.map(lambda x: x[-1], prefix[:3]), den_floor)


def _chunk_scan(prepare, xs, t, eps, initial_state, den_floor):
    """The chunked causal recurrence over `xs` (leading axis: the n chunks of length c).

    ``prepare(x)`` maps one chunk of `xs` to its heads-first ``(pq [B, H, c, M],
    pk [B, H, c, M], [v | 1] [B, H, c, Dv + 1], log_decay, ns, mass [B, H, c])``, the keys
    already masked; `t` is the unpadded length. Returns ``(out [B, t, H, Dv],
    RecurrentState)`` as `causal_chunked`.

    The carry is the state before a chunk, kept relative to the running key max mp:
    ``s = sum_j exp(n_j - mp) phi(k_j) v_j^T`` ``[B, H, M, Dv]``, z likewise ``[B, H, M]``,
    carried as one ``sz = [s | z]`` ``[B, H, M, Dv + 1]`` (the values as ``[v | 1]``), so
    that each product gives a numerator and its denominator together; ``zm`` ``[B, H]`` is
    the floor's mass channel.
    """
    shapes = jax.eval_shape(prepare, jax.tree.map(lambda x: x[0], xs))
    b, h, c, m = shapes[0].shape
    dv = shapes[2].shape[-1] - 1
    tril = jnp.tril(jnp.ones((c, c), bool))

    def step(carry, x):
        prepared = prepare(x)
        out = _chunk_output(carry, prepared, tril, eps, den_floor)
        return _chunk_update(carry, prepared), out

    carry, out = lax.scan(step, _initial_carry(initial_state, b, h, m, dv, den_floor), xs)
    return _unchunk(out, t), _final_state(carry, den_floor)


def _unchunk(out, t):
    """Chunk outputs ``[n, B, H, c, Dv]`` -> ``[B, t, H, Dv]`` (the padding dropped)."""
    n, b, h, c, dv = out.shape
    return jnp.moveaxis(out, 0, 2).reshape(b, h, n * c, dv).swapaxes(1, 2)[:, :t]
