"""The two T-long parts of LARA (`linattn_jax.lara`), each with a hand-written VJP.

Per head, with N terms t (draws omega_t), keys m and queries n (notation of
`linattn_jax.ra_common`; inputs heads-first, scaled: ``x^ = x d^(-1/4)``):

    key_stats:     f_t = sum_m softmax_m(a_tm) v_m,  lse_t = logsumexp_m a_tm,
                   a_tm = omega_t . k^_m - |k^_m|^2 / 2
    query_weights: out_n = sum_t w_nt f_t / sum_t w_nt,
                   w_nt = max(alpha_nt, ALPHA_FLOOR) exp(omega_t . q^_n + c_t - max_t (.))

The VJPs are the softmax backward of each part written out (``da = p (dp - sum p dp)``
with ``sum_m p dp = f . df``; ``ds = A (f . dout - out . dout)`` with ``A = w / sum_t w``),
with the normalisers folded into the small ``[B, H, N, Dv]`` / ``[B, Tq, H, Dv]``
cotangents. They keep the forward's exponentials (``e``, ``w``; ``r`` for ``mis="opt"``) and
take fewer passes over the ``[B, H, N, T]`` arrays than autodiff of the forward does. Inside
``shard_map`` (`seq_axis`, where the sums run over the devices) autodiff differentiates the
same forward code instead. Being custom VJPs, they take reverse-mode differentiation only:
``jax.jvp`` (and ``jacfwd``) through one-device lara raise JAX's custom_vjp error.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from linattn_jax import _seq, core
from linattn_jax.ra_common import masked_softmax, sq_half

#: LARA's MIS weights alpha are clamped below at this value (official code: 1e-8).
ALPHA_FLOOR = 1e-8


def key_stats(omega, kh, v, mask=None, seq_axis=None):
    """LARA's key statistics per term: ``(f [B, H, N, Dv], lse [B, H, N])``.

    ``f_t = sum_m softmax_m(a_tm) v_m`` and ``lse_t = logsumexp_m a_tm`` with ``a_tm =
    omega_t . k^_m - |k^_m|^2 / 2``, from one exponential of ``a``. `omega` ``[B, H, N,
    d]``, `kh` ``[B, H, Tk, d]``, `v` ``[B, H, Tk, Dv]``, `mask` None or ``[B, 1, 1, Tk]``
    bool (masked keys take no part; all masked: f = 0). `seq_axis`: the keys are split over
    that mesh axis inside ``shard_map``; the max and the sums run over its devices.
    """
    if seq_axis is None:
        return _key_stats_vjp(omega, kh, v, mask)
    return _key_stats(omega, kh, v, mask, seq_axis)[0]


def query_weights(omega, q_bar, qh, c, bh, f, masks, spec, seq_axis=None):
    """LARA's self-normalised MIS estimate ``out [B, Tq, H, Dv]`` from the key statistics.

    ``out_n = sum_t w_nt f_t / sum_t w_nt``, ``w_nt = max(alpha_nt, ALPHA_FLOOR)
    exp(s_nt - max_t s_nt)``, ``s_nt = omega_t . q^_n + c_t`` (``c = lse - log g_own``),
    ``alpha_nt = bh_t + gamma (r_{n c_t} - mean_c r_nc)`` (``spec.opt``; else bh_t) and
    ``r_nc = softmax_n(q~_c . q^_n)``. `omega` ``[B, H, N, d]``, `q_bar` ``[B, H, L, d]``,
    `qh` ``[B, H, Tq, d]``, `c`, `bh` ``[B, H, N]``, `f` ``[B, H, N, Dv]``; `masks` None or
    ``(term_valid [B, 1, N, 1], q_valid [B, 1, 1, Tq], valid_c [B, 1, L, 1])``; `spec` a
    `QuerySpec`. `seq_axis`: the queries are split over that mesh axis inside
    ``shard_map`` (the softmax over n in r runs over its devices).
    """
    if seq_axis is None:
        return _query_weights_vjp(omega, q_bar, qh, c, bh, f, masks, spec)
    return _query_weights(omega, q_bar, qh, c, bh, f, masks, spec, seq_axis)[0]


def _key_stats(omega, kh, v, mask=None, seq_axis=None):
    """`key_stats` and what its VJP keeps: ``((f, lse), (e, den))``, ``e = exp(a - max_m a)``
    ``[B, H, N, Tk]`` and ``den = sum_m e``."""
    a = jnp.einsum("bhnd,bhmd->bhnm", omega, kh) - sq_half(kh)[:, :, None, :]
    if mask is not None:
        a = jnp.where(mask, a, -jnp.inf)
        m = _seq.masked_max(a, mask, -1, seq_axis)
    else:
        m = _seq.pmax(lax.stop_gradient(jnp.max(a, axis=-1, keepdims=True)), seq_axis)
    e = jnp.exp(a - m)
    den = _seq.psum(jnp.sum(e, axis=-1, keepdims=True), seq_axis)
    if mask is not None:
        den = jnp.where(den > 0, den, 1.0)
    f = _seq.psum(jnp.einsum("bhnm,bhmd->bhnd", e, v), seq_axis) / den
    return (f, (jnp.log(den) + m)[..., 0]), (e, den)


@jax.custom_vjp
def _key_stats_vjp(omega, kh, v, mask):
    return _key_stats(omega, kh, v, mask)[0]


def _key_stats_fwd(omega, kh, v, mask):
    (f, lse), (e, den) = _key_stats(omega, kh, v, mask)
    return (f, lse), (omega, kh, v, e, den, f)


def _key_stats_bwd(res, cts):
    # p = e / den; da = p (df . v - f . df + dlse), with 1/den folded into the small df.
    omega, kh, v, e, den, f = res
    df, dlse = cts
    df_den = df / den
    dp = jnp.einsum("bhnd,bhmd->bhnm", df_den, v)
    da = e * (dp - ((jnp.sum(f * df, -1) - dlse)[..., None] / den))
    domega = jnp.einsum("bhnm,bhmd->bhnd", da, kh)
    dkh = jnp.einsum("bhnm,bhnd->bhmd", da, omega) - jnp.sum(da, axis=2)[..., None] * kh
    dv = jnp.einsum("bhnm,bhnd->bhmd", e, df_den)
    return domega, dkh, dv, None


_key_stats_vjp.defvjp(_key_stats_fwd, _key_stats_bwd)


class QuerySpec(NamedTuple):
    """Static settings of `query_weights`: ``opt`` (the ``mis="opt"`` correction), its
    ``gamma`` (``alpha_coeff``) and ``per`` (terms per proposal)."""

    opt: bool
    gamma: float
    per: int


def _alpha(bh, r, masks, spec):
    """MIS weights ``alpha_nt = bh_t + gamma (r_{n c_t} - mean_c r_nc)`` ``[B, H, N, Tq]``
    (``[B, H, N, 1]``, bh alone, without the correction)."""
    alpha = bh[..., None]
    if not spec.opt:
        return alpha
    if masks is None:
        corr = r - jnp.mean(r, axis=2, keepdims=True)
    else:
        cv = masks[2]
        n_c = jnp.maximum(jnp.sum(cv, axis=2, keepdims=True), 1)
        corr = r - jnp.sum(jnp.where(cv, r, 0.0), axis=2, keepdims=True) / n_c
    return alpha + spec.gamma * (corr if spec.per == 1 else jnp.repeat(corr, spec.per, axis=2))


def _query_weights(omega, q_bar, qh, c, bh, f, masks, spec, seq_axis=None):
    """`query_weights` and what its VJP keeps: ``(out, (w, den, r))``, ``w [B, H, N, Tq]``,
    ``den [B, Tq, H, 1]`` and r (None unless ``spec.opt``)."""
    r = None
    if spec.opt:
        logits = jnp.einsum("bhcd,bhqd->bhcq", q_bar, qh)
        if masks is not None:
            r = masked_softmax(logits, masks[1] & masks[2], -1, seq_axis)
        elif seq_axis is not None:
            r = masked_softmax(logits, True, -1, seq_axis)
        else:
            r = jax.nn.softmax(logits, axis=-1)
    s = jnp.einsum("bhnd,bhqd->bhnq", omega, qh) + c[..., None]
    if masks is not None:
        s = jnp.where(masks[0], s, -jnp.inf)
        s_max = lax.stop_gradient(core.masked_max(s, masks[0], 2))
    else:
        s_max = lax.stop_gradient(jnp.max(s, axis=2, keepdims=True))
    w = jnp.maximum(_alpha(bh, r, masks, spec), ALPHA_FLOOR) * jnp.exp(s - s_max)
    den = jnp.sum(w, axis=2, keepdims=True)  # [B, H, 1, Tq]
    if masks is not None:
        den = jnp.where(den > 0, den, 1.0)
    den_t = jnp.transpose(den, (0, 3, 1, 2))  # [B, Tq, H, 1]
    return jnp.einsum("bhnq,bhnd->bqhd", w, f) / den_t, (w, den_t, r)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _query_weights_vjp(omega, q_bar, qh, c, bh, f, masks, spec):
    return _query_weights(omega, q_bar, qh, c, bh, f, masks, spec)[0]


def _query_weights_fwd(omega, q_bar, qh, c, bh, f, masks, spec):
    out, (w, den_t, r) = _query_weights(omega, q_bar, qh, c, bh, f, masks, spec)
    return out, (omega, q_bar, qh, bh, f, masks, w, den_t, r, out)


def _query_weights_bwd(spec, res, dout):
    # With A = w / den: ds = A (f . dout - out . dout) (a softmax over t), and
    # d alpha = ds / max(alpha, floor) where alpha > floor; 1/den is folded into dout.
    omega, q_bar, qh, bh, f, masks, w, den_t, r, out = res
    dout_den = dout / den_t
    g = jnp.einsum("bhnd,bqhd->bhnq", f, dout_den)
    o = jnp.transpose(jnp.sum(out * dout_den, -1), (0, 2, 1))[:, :, None, :]  # [B, H, 1, Tq]
    ds = w * (g - o)
    df = jnp.einsum("bhnq,bqhd->bhnd", w, dout_den)
    alpha = _alpha(bh, r, masks, spec)
    dalpha = jnp.where(alpha > ALPHA_FLOOR, ds / jnp.maximum(alpha, ALPHA_FLOOR), 0.0)
    dbh = jnp.sum(dalpha, axis=-1)
    domega = jnp.einsum("bhnq,bhqd->bhnd", ds, qh)
    dqh = jnp.einsum("bhnq,bhnd->bhqd", ds, omega)
    dq_bar = jnp.zeros_like(q_bar)
    if spec.opt:
        dcorr = spec.gamma * dalpha
        if spec.per > 1:
            b, h, _, tq = dcorr.shape
            dcorr = dcorr.reshape(b, h, -1, spec.per, tq)
        dr_own = dcorr if spec.per == 1 else jnp.sum(dcorr, axis=3)  # [B, H, L, Tq]
        total = jnp.sum(dr_own, axis=2, keepdims=True)
        if masks is None:
            dr = dr_own - total / r.shape[2]
        else:
            cv = masks[2]
            n_c = jnp.maximum(jnp.sum(cv, axis=2, keepdims=True), 1)
            dr = dr_own - jnp.where(cv, total / n_c, 0.0)
        dlogits = r * (dr - jnp.sum(r * dr, axis=-1, keepdims=True))
        dq_bar = jnp.einsum("bhcq,bhqd->bhcd", dlogits, qh)
        dqh = dqh + jnp.einsum("bhcq,bhcd->bhqd", dlogits, q_bar)
    return domega, dq_bar, dqh, jnp.sum(ds, axis=-1), dbh, df, None


_query_weights_vjp.defvjp(_query_weights_fwd, _query_weights_bwd)


__all__ = ["ALPHA_FLOOR", "QuerySpec", "key_stats", "query_weights"]
