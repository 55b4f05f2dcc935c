"""Randomized attention (RA), Zheng et al. 2022 (seed 004): unbiased for softmax, O(T^2).

``ra`` samples the query-specific proposal p_n exactly (notation, random draws and
gradients: `linattn_jax.ra_common`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from linattn_jax import _checks, core
from linattn_jax.ra_common import check_samples, masked_softmax, sq_half
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


def ra_draws(key, batch: int, q_len: int, num_heads: int, head_dim: int, offset=0):
    """One RA draw per query: ``(u [B, H, Tq] ~ U(0, 1), eps [B, Tq, H, d] ~ N(0, I))``.

    Query n's values come from one ``normal(fold_in(key, n), (B, H, d + 1))``: the
    first d coordinates are eps and ``u = Phi(z_d)`` (the normal CDF of the last one
    is uniform). Indexed by position, they do not depend on the sequence length
    (padding-invariant); one Gaussian draw per position keeps the traced RNG small.
    `offset` (an int, traced or not): the draws of positions ``offset .. offset + Tq - 1``
    (a block of queries, `_ra`).
    """
    z = jax.vmap(
        lambda n: jax.random.normal(
            jax.random.fold_in(key, n), (batch, num_heads, head_dim + 1), _f32
        )
    )(offset + jnp.arange(q_len))  # [Tq, B, H, d + 1]
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
    check_samples("ra", rng, deterministic, num_samples)


def ra_attention(
    q, k, v, params, rng=None, *, mask=None, causal=False, deterministic=False, num_samples=1
):
    """Randomized attention (RA), ``[B, Tq, H, Dv]`` in q's dtype. Quadratic, unbiased.

    Per query n (paper eq. for RA): ``pi_n = softmax_m(q^_n . k^_m)`` over the keys
    it may attend to; draw ``m* ~ pi_n``, ``eps ~ N(0, I)``, ``omega_n = q^_n +
    k^_{m*} + eps`` and return ``f_n(omega_n) = sum_j softmax_j(omega_n . k^_j -
    |k^_j|^2 / 2) v_j``. ``E[out_n]`` is exactly softmax attention. `num_samples`
    S > 1 averages S independent draws (a `lax.scan`, one ``[B, H, Tq, Tk]`` score
    matrix live at a time; the backward pass recomputes a draw's ``f`` from its kept draw,
    `DRAW`).
    ``deterministic=True``: ``omega_n = q^_n + sum_m pi_nm k^_m`` (no rng).

    Unbiasedness needs the noise to match the proposal density: eps has unit variance in
    the scaled space, as the paper writes it. The official RA (HKUNLP efficient-attention)
    adds its noise before the ``d^(-1/4)`` scaling (an effective std of ``d^(-1/4)``), which
    makes it biased: its error against softmax stops falling as the samples grow, where an
    unbiased estimator's keeps falling at the Monte-Carlo rate.

    Args:
      q: ``[B, Tq, H, Dk]``.
      k: ``[B, Tk, H, Dk]``.
      v: ``[B, Tk, H, Dv]``.
      params: ``{}``.
      rng: a `jax.random.key` (needed unless deterministic).
      mask: ``[B, Tk]`` bool key padding (True = attend).
      causal: query i sees keys j <= i, in both pi_i and the softmax of f_i.
      num_samples: S, independent draws averaged.
    """
    del params
    _check_ra(q, k, v, mask, causal, rng, deterministic, num_samples)
    valid = _ra_valid(mask, causal, q.shape[0], q.shape[1], k.shape[1])  # [B, 1, Tq, Tk]
    return _ra(q, k, v, valid, None, None, rng, deterministic, num_samples)


#: Queries per block of RA over a sequence of more than two blocks (`_ra`): one block's
#: ``[B, H, block, Tk]`` score arrays at a time, not ``[B, H, Tq, Tk]``.
QUERY_BLOCK = 128
#: The name of a draw's chosen keys and its omega (`_ra_block`): a recomputed block or
#: sample (`_REMAT`) keeps them, ``[B, H, Tq]`` and ``[B, Tq, H, d]``, so its backward pass
#: recomputes only ``f(omega)``, not the proposal's scores, softmax and inverse CDF.
DRAW = "ra_draw"
_REMAT = functools.partial(
    jax.checkpoint, prevent_cse=False, policy=jax.checkpoint_policies.save_only_these_names(DRAW)
)


def _ra(q, k, v, valid, bias, drop, rng, deterministic, num_samples):
    """RA over a ``[B, 1|H, Tq, Tk]`` `valid` pattern, with an optional additive `bias`
    (broadcastable to ``[B, H, Tq, Tk]``) and a dropout multiplier `drop` on the weights of
    ``f``. A bias b_nj enters the proposal and ``f`` alike: it is a log prior c_j = e^b_nj on
    the keys of query n, and ``sum_j c_j exp(q.k_j) N(w; q + k_j, I)`` factors the same way
    as without it, so ``E[out_n]`` is ``softmax(q.k / sqrt(d) + b)`` attention; `drop` is
    linear in ``f``'s weights, so ``E[out]`` is the same dropped-out softmax attention.

    Queries are independent: over more than ``2 * QUERY_BLOCK`` of them they are taken
    `QUERY_BLOCK` at a time (a `lax.map`; the backward pass recomputes a block's ``f`` from
    its kept draws, `DRAW`, not its proposal), so
    the score arrays are one block's, not ``[B, H, Tq, Tk]``. With a threefry key the draws
    (indexed by position, `ra_draws`) and so the values are those of the whole pass; an
    "rbg" key's draws under `jax.vmap` depend on the batch, so they differ (equally
    valid draws)."""
    b, tq, h, d = q.shape
    qh, kh, v32 = core.scale_inputs(q), core.scale_inputs(k), v.astype(_f32)
    bias = jnp.zeros((1, 1, 1, 1), _f32) if bias is None else jnp.asarray(bias, _f32)
    bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    drop = jnp.ones((1, 1, 1, 1), _f32) if drop is None else drop
    keys = None if deterministic else _sample_keys(rng, num_samples)
    per_query = (qh, valid, bias, drop)  # the query axis: 1 of qh, -2 of the others
    if tq <= 2 * QUERY_BLOCK:
        return _ra_block(keys, 0, kh, v32, *per_query).astype(q.dtype)
    c, n = QUERY_BLOCK, -(-tq // QUERY_BLOCK)
    pad = n * c - tq

    def blocks(x, axis):
        if x.shape[axis] == 1:  # broadcast over the queries: the same for every block
            return None, x
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, pad)
        x = jnp.pad(x, widths, mode="edge") if pad else x
        x = x.reshape(x.shape[:axis] + (n, c) + x.shape[axis + 1 :])
        return jnp.moveaxis(x, axis, 0), None

    split = [blocks(x, 1 if i == 0 else 2) for i, x in enumerate(per_query)]
    xs = tuple(x for x, _ in split)

    @_REMAT
    def one_block(i, xs):
        args = [x if x is not None else same for x, (_, same) in zip(xs, split, strict=True)]
        return _ra_block(keys, i * c, kh, v32, *args)

    out = lax.map(lambda ixs: one_block(*ixs), (jnp.arange(n), xs))  # [n, B, c, H, Dv]
    out = jnp.moveaxis(out, 0, 1).reshape(b, n * c, h, -1)[:, :tq]
    return out.astype(q.dtype)


def _ra_block(keys, offset, kh, v32, qh, valid, bias, drop):
    """`_ra` of the queries at positions ``offset ..`` (their scaled `qh` ``[B, c, H, d]``
    and their rows of `valid`, `bias`, `drop`), from the sample `keys` (None: the
    deterministic form); float32 ``[B, c, H, Dv]``."""
    b, tq, h, d = qh.shape
    tk = kh.shape[1]
    logits = jnp.einsum("bihd,bjhd->bhij", qh, kh) + bias
    pi = masked_softmax(logits, valid, -1)  # [B, H, Tq, Tk]
    k_bias = jnp.transpose(sq_half(kh), (0, 2, 1))[:, :, None, :]  # [B, H, 1, Tk]
    kh_h = jnp.transpose(kh, (0, 2, 1, 3))  # [B, H, Tk, d]

    def f(omega):  # [B, Tq, H, d] -> [B, Tq, H, Dv]
        w = masked_softmax(jnp.einsum("bihd,bjhd->bhij", omega, kh) - k_bias + bias, valid, -1)
        return jnp.einsum("bhij,bjhd->bihd", w * drop, v32)

    if keys is None:
        return f(qh + jnp.einsum("bhij,bjhd->bihd", pi, kh))

    # Inverse-CDF sampling of m* (see the module docstring); no gradient through the choice.
    cdf = jnp.cumsum(lax.stop_gradient(pi), axis=-1)  # [B, H, Tq, Tk]
    last = jnp.max(jnp.where(pi > 0, jnp.arange(tk), 0), axis=-1)  # [B, H, Tq]

    def one(key):
        u, eps = ra_draws(key, b, tq, h, d, offset)
        idx = jnp.sum(cdf <= (u * cdf[..., -1])[..., None], axis=-1)  # first j with cdf_j > u
        idx = jnp.minimum(idx, last)  # u * total rounded up to total: the last valid key
        idx = checkpoint_name(idx, DRAW)
        k_star = jnp.take_along_axis(kh_h, idx[..., None], axis=2)  # [B, H, Tq, d]
        return f(checkpoint_name(qh + jnp.transpose(k_star, (0, 2, 1, 3)) + eps, DRAW))

    if keys.shape[0] == 1:
        return one(keys[0])

    def body(acc, key):
        return acc + one(key), None

    acc0 = jnp.zeros((b, tq, h, v32.shape[-1]), _f32)
    total, _ = lax.scan(_REMAT(body), acc0, keys)
    return total / keys.shape[0]


def ra_flax_attention(
    q,
    k,
    v,
    rng=None,
    *,
    mask=None,
    bias=None,
    causal=False,
    num_samples=1,
    dropout_rate=0.0,
    dropout_rng=None,
    broadcast_dropout=True,
):
    """RA under flax's ``dot_product_attention`` conventions: any mask, bias and dropout.

    `mask`: bool, broadcastable to ``[B, H, Tq, Tk]`` (True = attend; per head and per
    query, e.g. ``nn.make_causal_mask``). `bias`: additive, broadcastable to the same.
    ``E[out]`` is ``nn.dot_product_attention(q, k, v, bias, mask, ...)`` with the same
    dropout (see `_ra`), except on a query row with no key to attend to (a padded query),
    which attends as the key padding of its batch row (the keys any row attends to) here
    and is flax's uniform average there. Dropout keeps flax's rng semantics: ``keep =
    bernoulli(dropout_rng, 1 - dropout_rate, shape)``, shape ``[1, 1, Tq, Tk]`` with
    `broadcast_dropout` else ``[B, H, Tq, Tk]``, scaled by ``1 / (1 - dropout_rate)``, on the
    weights of RA's ``f``. `rng` samples (None: the deterministic form). Draws are indexed
    by query position, so each query row's output depends on its own mask row alone.
    """
    _check_ra(q, k, v, None, causal, rng, rng is None, num_samples)
    b, tq, h, _ = q.shape
    tk = k.shape[1]
    shape = (b, h, tq, tk)
    valid = jnp.ones((1, 1, tq, tk), bool) if mask is None else jnp.asarray(mask, bool)
    allowed = _ra_valid(None, causal, b, tq, tk)
    valid = allowed & jnp.broadcast_to(valid, shape)
    # A row with no key (a padded query) takes the key padding of its batch row, as the
    # key-padding mechanisms do inside flax's modules; flax's own output there is meaningless.
    pad = jnp.any(valid, axis=(1, 2))[:, None, None, :] & allowed
    valid = jnp.where(jnp.any(valid, axis=-1, keepdims=True), valid, pad)
    drop = None
    if dropout_rate > 0:
        if dropout_rng is None:
            raise ValueError(f"dropout_rate={dropout_rate}: ra needs a dropout_rng to drop out")
        keep_prob = 1.0 - dropout_rate
        drop_shape = (1, 1, tq, tk) if broadcast_dropout else shape
        keep = jax.random.bernoulli(dropout_rng, keep_prob, drop_shape)
        drop = keep.astype(_f32) / keep_prob
    return _ra(q, k, v, valid, bias, drop, rng, rng is None, num_samples)


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


def ra_flax_fn(
    mech, q, k, v, rng=None, *, bias, mask, causal, module, force_fp32_for_softmax, einsums,
    broadcast_dropout, dropout_rng, dropout_rate, deterministic, dtype, precision,
):  # fmt: skip
    """ra under flax's conventions (the record's `Mechanism.flax_fn`): `ra_flax_attention`
    with flax's mask, bias and dropout, `mech`'s ``num_samples``. With dropout on, ra
    samples with ``fold_in(rng, 1)``: flax's keep mask takes `dropout_rng` itself, which is
    also the sampling key flax's modules hand a sampling mechanism. `rng` None: the
    deterministic form. Refuses ``sow_weights`` (`module`) and custom einsums."""
    del force_fp32_for_softmax
    _checks.refuse_unsupported(mech.name, module=module, einsums=einsums)
    dropout_rate = 0.0 if deterministic else dropout_rate
    if rng is not None and dropout_rate > 0:
        rng = jax.random.fold_in(rng, 1)
    if dtype is not None:
        q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    with _checks.matmul_precision(mech.name, precision):
        return ra_flax_attention(
            q, k, v, rng, mask=mask, bias=bias, causal=causal,
            num_samples=mech.defaults["num_samples"], dropout_rate=dropout_rate,
            dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout,
        )  # fmt: skip


RA = register(
    Mechanism(
        name="ra",
        init_fn=ra_init,
        attention_fn=ra_attention,
        reference_fn=ra_reference,
        supports_causal=True,
        stochastic=True,
        description="randomized attention, unbiased for softmax (Zheng et al. 2022), O(T^2)",
        flax_fn=ra_flax_fn,
        attention_dropout=True,
    )
)

__all__ = [
    "RA",
    "ra_attention",
    "ra_draws",
    "ra_flax_attention",
    "ra_flax_fn",
    "ra_init",
    "ra_reference",
]
