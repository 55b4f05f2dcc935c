"""Linear randomized attention (LARA), Zheng et al. 2022 (seed 004): O(T C).

``lara`` replaces RA's T query-specific proposals by C shared Gaussians centred on
landmarks and combines them by self-normalised multiple importance sampling (MIS)
(notation, random draws and gradients: `linattn_jax.ra_common`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from linattn_jax import _checks, core, landmarks, lara_core
from linattn_jax.lara_core import ALPHA_FLOOR
from linattn_jax.ra_common import check_samples, masked_softmax, sq_half
from linattn_jax.registry import Mechanism, register

_f32 = jnp.float32

#: LayerNorm epsilon of the learned proposal.
LN_EPS = 1e-5

_PROPOSALS = ("mean", "adaptive-1d", "pool", "learned")
_MIS = ("opt", "bh")


def _masked_logsumexp(logits, valid, axis, fill=0.0):
    """``logsumexp`` over `axis` restricted to `valid`; `fill` where nothing is valid."""
    m = lax.stop_gradient(core.masked_max(logits, valid, axis))
    e = jnp.exp(jnp.where(valid, logits - m, -jnp.inf))
    den = jnp.sum(e, axis=axis, keepdims=True)
    out = jnp.log(jnp.where(den > 0, den, 1.0)) + m
    return jnp.squeeze(jnp.where(den > 0, out, fill), axis)


#: Proposal networks (params). ``"learned"``: per token on the scaled q^, k^ (kept for
#: existing configs); ``"adaptive-1d"``: per token on the unscaled q, k (the official
#: code); ``"pool"``: on the pooled landmarks of the unscaled q, k (the official 2-D one).
_NETS = ("learned", "adaptive-1d", "pool")


def _learned_names(side: str):
    return (f"proj_{side}_w", f"proj_{side}_b", f"ln_{side}_scale", f"ln_{side}_bias")


def lara_init(rng, *, num_heads: int, head_dim: int, proposal: str = "mean"):
    """LARA params: ``{}`` for ``proposal="mean"``; for a proposal network, per side s in {q, k}:

    ``proj_s_w [H, d, d]`` (init identity), ``proj_s_b [H, d]`` (0),
    ``ln_s_scale [H, d]`` (1), ``ln_s_bias [H, d]`` (0): the map ``LayerNorm(x W + b)``,
    per head, applied to q, k before the landmark means (``"learned"``: on the scaled q^,
    k^; ``"adaptive-1d"``: on the unscaled q, k, then scaled by ``d^(-1/4)``) or to the
    landmarks of the unscaled q, k (``"pool"``, then scaled). The official code shares one
    ``Linear(d, d) + LayerNorm(d)`` across heads ("light" pool module); we keep one per head.
    Its init is PyTorch's default (random); ours is deterministic (`rng` unused). Even at
    init a network's proposal differs from ``"mean"``: LayerNorm standardises each vector.
    """
    del rng
    _checks.check_choice("lara", "proposal", proposal, _PROPOSALS)
    if proposal == "mean":
        return {}
    h, d = num_heads, head_dim
    eye = jnp.broadcast_to(jnp.eye(d, dtype=_f32), (h, d, d))
    params = {}
    for side in ("q", "k"):
        w, bias, scale, shift = _learned_names(side)
        params[w] = eye
        params[bias] = jnp.zeros((h, d), _f32)
        params[scale] = jnp.ones((h, d), _f32)
        params[shift] = jnp.zeros((h, d), _f32)
    return params


def _proposal_features(x, params, side):
    """``LayerNorm(x W + b)`` per token and head: ``[B, T, H, d] -> [B, T, H, d]``."""
    w, bias, scale, shift = (params[n].astype(_f32) for n in _learned_names(side))
    y = jnp.einsum("bthd,hde->bthe", x, w) + bias[None, None]
    mean = jnp.mean(y, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(y - mean), axis=-1, keepdims=True)
    return (y - mean) * lax.rsqrt(var + LN_EPS) * scale[None, None] + shift[None, None]


def _check_lara(q, k, v, params, mask, causal, rng, deterministic, cfg):
    _checks.check_inputs("lara", q, k, v, mask, causal=causal)
    _checks.check_causal_supported("lara", causal)
    _checks.check_positive("lara", num_landmarks=cfg.num_landmarks)
    check_samples("lara", rng, deterministic, cfg.num_samples)
    _checks.check_choice("lara", "proposal", cfg.proposal, _PROPOSALS)
    _checks.check_choice("lara", "mis", cfg.mis, _MIS)
    for key in ("antithetic", "mixed"):
        _checks.check_bool("lara", key, getattr(cfg, key))
    alpha_coeff, noise_scale, grid = cfg.alpha_coeff, cfg.noise_scale, cfg.grid
    _checks.check_float(
        "lara", "alpha_coeff", alpha_coeff, lambda a: 0.0 <= a < math.inf, "a finite float >= 0"
    )
    if noise_scale is not None:
        _checks.check_float(
            "lara", "noise_scale", noise_scale, lambda s: 0.0 < s < math.inf,
            "None (d ** -0.25) or a finite float > 0",
        )  # fmt: skip
    if grid is not None:
        if (
            not isinstance(grid, tuple)
            or len(grid) != 2
            or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 1 for g in grid)
        ):
            raise ValueError(
                f"lara: grid must be None or a tuple (h, w) of ints >= 1, got {grid!r}"
            )
        for arg, x in (("q", q), ("k", k)):
            if grid[0] * grid[1] > x.shape[1]:
                raise ValueError(
                    f"lara: grid={grid} has {grid[0] * grid[1]} cells, more than the length of "
                    f"{arg} {x.shape}"
                )
    if cfg.proposal in _NETS:
        h, d = q.shape[2], q.shape[3]
        shapes = {}
        for side in ("q", "k"):
            w, bias, scale, shift = _learned_names(side)
            shapes.update({w: (h, d, d), bias: (h, d), scale: (h, d), shift: (h, d)})
        _checks.check_params("lara", params, shapes)


class _Cfg(NamedTuple):
    num_landmarks: int
    num_samples: int
    proposal: str
    grid: tuple[int, int] | None
    antithetic: bool
    mis: str
    alpha_coeff: float
    noise_scale: float | None
    mixed: bool


def _lara_proposals(q, k, params, mask, cfg, seq_axis=None):
    """Landmarks and proposal means.

    Returns ``(q_bar, mu, valid_c, q_mask)``: query landmarks ``q~ [B, L, H, d]``, proposal
    means ``mu = q~ + k~ [B, L, H, d]`` (both in the scaled space), ``valid_c [B, L]`` (both
    landmarks of slot c exist) and the query mask (None or ``[B, Tq]``).

    Query and key landmarks use the same slot count L: ``min(C, Tq, Tk)`` for 1-D
    segments (`landmarks.num_landmarks` with the grid for 2-D). The key mask is
    used for the key landmarks and, when ``Tq == Tk`` (self-attention), also for the
    query landmarks and the query statistics r_nc (padded queries take no part).
    ``mixed=True`` replaces each key landmark by ``sum_c' softmax_c'(k~_c . k~_c') k~_c'``
    (the official 2-D "-mixed" proposals; over the valid slots). ``"mean"`` averages the
    unscaled q, k and scales the means (the same numbers: a mean is linear), so no scaled
    copy of the inputs is made here.

    `seq_axis`: q, k, mask are this device's parts of sequences split along T over that
    mesh axis; the landmarks are those of the whole sequences
    (`landmarks.sharded_landmarks`), the same on every device.
    """
    tq, tk = q.shape[1], k.shape[1]
    d = q.shape[-1]
    proposal, grid = cfg.proposal, cfg.grid
    if proposal == "learned":
        pq = _proposal_features(core.scale_inputs(q), params, "q")
        pk = _proposal_features(core.scale_inputs(k), params, "k")
    elif proposal == "adaptive-1d":
        pq = _proposal_features(q.astype(_f32), params, "q") * d**-0.25
        pk = _proposal_features(k.astype(_f32), params, "k") * d**-0.25
    else:  # "mean" and "pool": landmarks of the unscaled inputs
        pq, pk = q.astype(_f32), k.astype(_f32)
    shards = 1 if seq_axis is None else lax.axis_size(seq_axis)
    m = cfg.num_landmarks if grid is not None else min(cfg.num_landmarks, tq * shards, tk * shards)
    q_mask = mask if (mask is not None and tq == tk) else None
    if seq_axis is None:
        q_bar, lq = landmarks.landmarks(pq, m, mask=q_mask, grid=grid)
        k_bar, lk = landmarks.landmarks(pk, m, mask=mask, grid=grid)
    else:
        q_bar, lq = landmarks.sharded_landmarks(pq, m, seq_axis, mask=q_mask, grid=grid)
        k_bar, lk = landmarks.sharded_landmarks(pk, m, seq_axis, mask=mask, grid=grid)
    if proposal == "pool":
        q_bar = _proposal_features(q_bar, params, "q") * d**-0.25
        k_bar = _proposal_features(k_bar, params, "k") * d**-0.25
    elif proposal == "mean":
        q_bar, k_bar = q_bar * d**-0.25, k_bar * d**-0.25
    valid_c = lq & lk
    if cfg.mixed:
        logits = jnp.einsum("bchd,behd->bhce", k_bar, k_bar)  # [B, H, L, L]
        mix = masked_softmax(logits, lk[:, None, None, :], -1)
        k_bar = jnp.einsum("bhce,behd->bchd", mix, k_bar)
    return q_bar, q_bar + k_bar, valid_c, q_mask


def resolve_noise_scale(noise_scale, head_dim: int) -> float:
    """Std of LARA's noise in the scaled space: `noise_scale`, or ``d ** -0.25`` when None."""
    return head_dim**-0.25 if noise_scale is None else float(noise_scale)


def lara_noise(
    key,
    batch: int,
    num_proposals: int,
    num_samples: int,
    num_heads,
    head_dim,
    *,
    antithetic: bool = False,
):
    """LARA noise ``eps [B, L, S', H, d] ~ N(0, I)``, ``S' = 2S`` if antithetic (``+eps, -eps``).

    Proposal c's noise comes from ``fold_in(key, c)`` (independent of L: padding-invariant).
    Unit variance; `lara_attention` multiplies it by the ``noise_scale``.
    """
    eps = jax.vmap(
        lambda c: jax.random.normal(
            jax.random.fold_in(key, c), (batch, num_samples, num_heads, head_dim), _f32
        )
    )(jnp.arange(num_proposals))
    eps = jnp.moveaxis(eps, 0, 1)
    if antithetic:
        eps = jnp.concatenate([eps, -eps], axis=2)
    return eps


def _lara_terms(q, k, params, rng, mask, deterministic, cfg, seq_axis=None, noise=None):
    """Shared setup of `lara_attention` and `lara_reference`: proposals and draws.

    `seq_axis` as `_lara_proposals`; `noise`: the unit draws (`lara_noise` of `rng`, made
    by the caller for the whole batch when the batch is split too) instead of `rng`.

    Returns a dict with ``omega [B, N, H, d]`` (N = L S' terms, proposal-major),
    ``per`` (S', terms per proposal), ``term_c [N]`` (the proposal of each term),
    ``term_valid [B, N]``, ``q_valid [B, Tq]`` and the outputs of `_lara_proposals`.
    """
    b, _, h, d = q.shape
    q_bar, mu, valid_c, q_mask = _lara_proposals(q, k, params, mask, cfg, seq_axis)
    n_prop = mu.shape[1]
    if deterministic:
        omega, per = mu, 1
    else:
        eps = noise
        if eps is None:
            eps = lara_noise(rng, b, n_prop, cfg.num_samples, h, d, antithetic=cfg.antithetic)
        eps = eps * resolve_noise_scale(cfg.noise_scale, d)
        omega = mu[:, :, None] + eps  # [B, L, S', H, d]
        per = omega.shape[2]
        omega = omega.reshape(b, n_prop * per, h, d)
    term_c = jnp.repeat(jnp.arange(n_prop), per)
    return dict(
        q_bar=q_bar,
        mu=mu,
        valid_c=valid_c,
        q_mask=q_mask,
        q_valid=core.key_mask(q_mask, q.shape[1], b),
        omega=omega,
        per=per,
        term_c=term_c,
        term_valid=valid_c[:, term_c],
    )


def _heads(x):
    return jnp.swapaxes(x, 1, 2)  # [B, T, H, d] <-> [B, H, T, d]


def lara_attention(
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
    num_samples=1,
    proposal="mean",
    grid=None,
    antithetic=False,
    mis="opt",
    alpha_coeff=1.0,
    noise_scale=None,
    mixed=False,
):
    """Linear randomized attention (LARA), ``[B, Tq, H, Dv]`` in q's dtype. O(C (Tq + Tk) d).

    C = `num_landmarks` Gaussian proposals ``g_c = N(mu_c, I)``, ``mu_c = q~_c + k~_c``
    (landmarks of q^, k^, see `_lara_proposals`; a proposal network first maps q, k, see
    `lara_init`; ``grid=(h, w)`` pools the last h*w tokens as an image). Each proposal
    draws `num_samples` ``omega = mu_c + s eps``, ``eps ~ N(0, I)`` (``mu_c +- s eps``
    pairs if `antithetic`; ``omega = mu_c`` and one term per proposal when
    deterministic), with ``s = noise_scale``. Every draw t = (c, s) is one term of the
    self-normalised MIS estimator (paper Sec. 4, SPEC Sec. 4 lara):

        f(omega_t) = sum_m softmax_m(log xi(k^_m, omega_t)) v_m
        log p~_n(omega_t) = log xi(q^_n, omega_t) + logsumexp_m log xi(k^_m, omega_t)
        log g_c(omega) = log xi(mu_c, omega)        (relative to N(0, I))
        alpha_nt = g_{c_t}(omega_t) / sum_c' g_c'(omega_t) + gamma (r_{n c_t} - mean_c r_nc)
        out_n = sum_t softmax_t(log alpha_nt + log p~_n(omega_t) - log g_{c_t}(omega_t)) f(omega_t)

    with ``r_nc = softmax_n(q^_n . q~_c)`` over (valid) queries, ``gamma =
    alpha_coeff`` (``mis="opt"``) or 0 (``mis="bh"``, the balance heuristic) and
    alpha clamped below at `ALPHA_FLOOR` (in both modes).

    Sampling noise (``noise_scale``; the paper is silent on it beyond "omega ~ g_c"): the
    densities g_c above have unit variance. ``noise_scale=1.0`` draws from them (the
    paper's math): self-normalised importance sampling is then consistent and the
    estimate converges to softmax attention as `num_samples` grows (where the clamp binds,
    i.e. a negative ``opt`` weight, it adds a small bias). The official code adds unit
    noise to the unscaled mu before its ``d^(-1/4)`` scaling, i.e. ``noise_scale = d **
    -0.25``, while its densities still assume variance 1: lower variance, but not
    consistent (the error stops falling with S). ``noise_scale=None`` (the default) is
    the official ``d ** -0.25``, chosen by training accuracy at equal budget:
    ListOps mini, 500 steps, seed 0 (``python -m train.results --tasks listops
    --attentions lara --steps 500 --set attention_config.noise_scale=X``, d = 16): test
    accuracy 38.4% / 37.2% (seeds 0 / 1, ``--set seed=1``) with X = 0.5 (= d ** -0.25)
    against 34.4% / 34.2% with X = 1.0. Pathfinder mini (same command, ``--tasks
    pathfinder``): 50.0% with both, chance at this budget, so it does not decide.

    Several samples per proposal: the MIS estimator is ``sum_c (1/S) sum_s w_c p~/g_c
    f``; every proposal has the same S, so the balance heuristic is the same ``g_c /
    sum_c' g_c'`` per draw and the common 1/S cancels in the self-normalisation: each
    draw is a term with its own alpha. Invalid landmark slots (fewer unmasked tokens
    than C) have weight 0. Non-causal only. Cost: with N = C S terms, O(N (Tq + Tk) d)
    plus O(N C d) for the proposal densities; no Tq x Tk array.

    Implementation (the math of `lara_reference`, arranged for speed): heads-first
    ``[B, H, N, T]`` arrays as the official code; one exponential of the key logits
    serves both f (softmax) and the p~ normaliser (logsumexp); ``-|q^_n|^2 / 2`` is
    dropped (constant over terms, it cancels in the softmax over t); the final weights
    are ``max(alpha, floor) exp(log p~ - log g - max)`` in linear space (no log of
    alpha); no mask arrays when `mask` is None. The two T-long parts
    (`linattn_jax.lara_core`) have hand-written VJPs: they keep the forward's exponentials
    and take fewer passes over the ``[B, H, N, T]`` arrays than autodiff of the forward
    (reverse mode only: ``jax.jvp`` through lara raises).

    Args:
      q: ``[B, Tq, H, Dk]``.
      k: ``[B, Tk, H, Dk]``.
      v: ``[B, Tk, H, Dv]``.
      params: ``{}`` or the proposal network (`lara_init`).
      rng: a `jax.random.key` (needed unless deterministic).
      mask: ``[B, Tk]`` bool key padding; respected in f, p~, the key landmarks, and
        (``Tq == Tk``) the query landmarks and r_nc.
      causal: must be False (LARA has no causal form).
      deterministic: one term per proposal at its mean (no rng), as the official code in
        evaluation.
      num_landmarks: C (default 64, as the Nystrom family; min(C, Tq, Tk) in 1-D; the
        ViT presets use 49 = 7 x 7 as the official code).
      num_samples: draws per proposal (default 1).
      proposal: ``"mean"`` (segment means of q^, k^, no params), ``"adaptive-1d"``
        (official: ``LayerNorm(Linear(.))`` per token on the unscaled q, k), ``"pool"``
        (official 2-D: the network on the pooled landmarks) or ``"learned"`` (ours
        before the official form was added: the per-token network on the scaled q^, k^;
        kept so existing configs and checkpoints still work).
      grid: optional ``(h, w)`` for 2-D pooling of the landmarks.
      antithetic: pair each draw eps with -eps (2 S terms per proposal).
      mis: ``"opt"`` (balance heuristic + query-dependent correction) or ``"bh"``.
      alpha_coeff: gamma of ``mis="opt"`` (default 1).
      noise_scale: std of the sampling noise in the scaled space; None = ``d ** -0.25``.
      mixed: mix the key landmarks by a softmax over their logits (official "-mixed").
    """
    cfg = _Cfg(
        num_landmarks, num_samples, proposal, grid, antithetic, mis, alpha_coeff, noise_scale,
        mixed,
    )  # fmt: skip
    _check_lara(q, k, v, params, mask, causal, rng, deterministic, cfg)
    t = _lara_terms(q, k, params, rng, mask, deterministic, cfg)
    return _lara(q, k, v, mask, t, cfg)


def _lara(q, k, v, mask, t, cfg, seq_axis=None):
    """`lara_attention` from the drawn terms `t` (`_lara_terms`) and the config `cfg`;
    `seq_axis`: the mesh axis the sequence is split over (`lara_sharded`).

    The two T-long parts are `linattn_jax.lara_core`'s (hand-written VJPs on one device).
    """
    qh, kh = (_heads(core.scale_inputs(x)) for x in (q, k))  # [B, H, T, d]
    v32 = _heads(v.astype(_f32))
    omega, mu = _heads(t["omega"]), _heads(t["mu"])  # [B, H, N, d], [B, H, L, d]
    masked = mask is not None
    kmask = mask[:, None, None, :] if masked else None  # [B, 1, 1, Tk]
    f, lse = lara_core.key_stats(omega, kh, v32, kmask, seq_axis)

    # Proposals: log g_c(omega_t) for every c and the term's own: [B, H, N, L], [B, H, N].
    log_g = jnp.einsum("bhnd,bhcd->bhnc", omega, mu) - sq_half(mu)[:, :, None, :]
    mu_t = mu if t["per"] == 1 else mu[:, :, t["term_c"]]
    log_g_own = jnp.sum(omega * mu_t, -1) - sq_half(mu_t)
    if masked:
        lse_g = _masked_logsumexp(log_g, t["valid_c"][:, None, None, :], -1)
        # <= 0 for a valid term; an invalid term's value is unused but could overflow exp.
        bh = jnp.exp(jnp.where(t["term_valid"][:, None, :], log_g_own - lse_g, 0.0))
        masks = (
            t["term_valid"][:, None, :, None],  # [B, 1, N, 1]
            t["q_valid"][:, None, None, :],  # [B, 1, 1, Tq]
            t["valid_c"][:, None, :, None],  # [B, 1, L, 1]
        )
    else:
        bh = jnp.exp(log_g_own - jax.nn.logsumexp(log_g, axis=-1))
        masks = None
    spec = lara_core.QuerySpec(cfg.mis == "opt", float(cfg.alpha_coeff), t["per"])
    # Queries: log p~_n(omega_t) - log g_own = omega_t . q^_n + c_t, up to -|q^_n|^2 / 2.
    c = lse - log_g_own
    out = lara_core.query_weights(omega, _heads(t["q_bar"]), qh, c, bh, f, masks, spec, seq_axis)
    return out.astype(q.dtype)


def lara_sharded(q, k, v, params, noise, *, mask=None, deterministic=False, seq_axis, **config):
    """`lara_attention` inside ``shard_map`` on q, k, v (and mask) split along T over the
    mesh axis `seq_axis` (`linattn_jax.parallel.sequence_parallel`), each device holding a
    contiguous part in axis order: the landmarks are those of the whole sequences, and the
    key softmax f, its normaliser and the query softmax r run over the devices; nothing
    T-long crosses devices. `noise`: this device's batch rows of `lara_noise` (the draws of
    the one-device call with the same rng; unused when deterministic). `config`: every
    config key of `lara_attention`. The inputs are not checked here: the caller checks the
    whole arrays (``jax.eval_shape`` of `lara_attention`).
    """
    cfg = _Cfg(**{key: config[key] for key in _Cfg._fields})
    t = _lara_terms(q, k, params, None, mask, deterministic, cfg, seq_axis, noise)
    return _lara(q, k, v, mask, t, cfg, seq_axis)


def lara_reference(
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
    num_samples=1,
    proposal="mean",
    grid=None,
    antithetic=False,
    mis="opt",
    alpha_coeff=1.0,
    noise_scale=None,
    mixed=False,
):
    """Straightforward LARA with the same landmarks and draws (the oracle of `lara_attention`).

    Materialises the ``[B, H, Tq, N, Tk]`` joint log-density ``log xi(q^_n, omega) +
    log xi(k^_m, omega)`` for p~, Gaussian log-densities ``-|omega - mu_c|^2/2 +
    |omega|^2/2`` for g_c, linear-space balance-heuristic ratios, and the estimate
    as an explicit ratio ``sum_t W_nt f_t / sum_t W_nt``.
    """
    cfg = _Cfg(
        num_landmarks, num_samples, proposal, grid, antithetic, mis, alpha_coeff, noise_scale,
        mixed,
    )  # fmt: skip
    _check_lara(q, k, v, params, mask, causal, rng, deterministic, cfg)
    t = _lara_terms(q, k, params, rng, mask, deterministic, cfg)
    return _lara_reference(q, k, v, mask, t, cfg)


def _lara_reference(q, k, v, mask, t, cfg):
    """`lara_reference` from the drawn terms `t` (`_lara_terms`) and the config `cfg`."""
    qh, kh = core.scale_inputs(q), core.scale_inputs(k)
    omega, mu = t["omega"], t["mu"]
    b, tq, h, _ = q.shape
    tk = k.shape[1]
    kv = core.key_mask(mask, tk, b)
    v32 = v.astype(_f32)

    def log_xi(x, w):  # x [B, T, H, d], w [B, N, H, d] -> [B, H, T, N]
        diff = jnp.einsum("bthd,bshd->bhts", x, w)
        return diff - 0.5 * jnp.sum(x * x, axis=-1).transpose(0, 2, 1)[..., None]

    lk = log_xi(kh, omega)  # [B, H, Tk, N]
    lk = jnp.where(kv[:, None, :, None], lk, -jnp.inf)
    joint = log_xi(qh, omega)[:, :, :, :, None] + jnp.swapaxes(lk, 2, 3)[:, :, None]
    m_joint = jnp.max(joint, axis=(-1,), keepdims=True)
    m_joint = jnp.where(jnp.isfinite(m_joint), m_joint, 0.0)
    log_p = jnp.log(jnp.sum(jnp.exp(joint - m_joint), axis=-1)) + m_joint[..., 0]  # [B,H,Tq,N]

    m_k = jnp.max(lk, axis=2, keepdims=True)
    m_k = jnp.where(jnp.isfinite(m_k), m_k, 0.0)
    wk = jnp.exp(lk - m_k)  # [B, H, Tk, N]
    f = jnp.einsum("bhmt,bmhd->bhtd", wk, v32) / jnp.maximum(jnp.sum(wk, axis=2), 1e-30)[..., None]

    # Gaussian log-densities relative to N(0, I), from squared distances.
    sq = jnp.sum(jnp.square(omega[:, :, None] - mu[:, None]), axis=-1)  # [B, N, L, H]
    log_g = (-0.5 * sq + 0.5 * jnp.sum(omega * omega, axis=-1)[:, :, None]).transpose(0, 3, 1, 2)
    log_g = jnp.where(t["valid_c"][:, None, None, :], log_g, -jnp.inf)  # [B, H, N, L]
    n_terms = omega.shape[1]
    own = jax.nn.one_hot(t["term_c"], mu.shape[1], dtype=bool)  # [N, L]
    log_g_own = jnp.sum(jnp.where(own[None, None], jnp.where(jnp.isfinite(log_g), log_g, 0), 0), -1)
    g_max = jnp.max(log_g, axis=-1, keepdims=True)
    g_max = jnp.where(jnp.isfinite(g_max), g_max, 0.0)
    g_rel = jnp.exp(log_g - g_max)
    bh = jnp.sum(jnp.where(own[None, None], g_rel, 0.0), -1) / jnp.maximum(
        jnp.sum(g_rel, axis=-1), 1e-30
    )  # [B, H, N]

    alpha = jnp.broadcast_to(bh[:, :, None, :], (b, h, tq, n_terms))
    if cfg.mis == "opt":
        qv = t["q_valid"]
        cv = t["valid_c"]
        logits = jnp.einsum("bnhd,bchd->bhnc", qh, t["q_bar"])
        logits = jnp.where(qv[:, None, :, None], logits, -jnp.inf)
        r = jax.nn.softmax(logits, axis=2)
        r = jnp.where(cv[:, None, None, :] & qv[:, None, :, None], r, 0.0)
        r_mean = (
            jnp.sum(r, axis=-1, keepdims=True)
            / jnp.maximum(jnp.sum(cv, -1), 1)[:, None, None, None]
        )
        alpha = alpha + cfg.alpha_coeff * jnp.take(r - r_mean, t["term_c"], axis=-1)
    log_w = jnp.log(jnp.maximum(alpha, ALPHA_FLOOR)) + log_p - log_g_own[:, :, None, :]
    tv = t["term_valid"][:, None, None, :]
    log_w = jnp.where(tv, log_w, -jnp.inf)
    w_max = jnp.max(log_w, axis=-1, keepdims=True)
    w_max = jnp.where(jnp.isfinite(w_max), w_max, 0.0)
    weights = jnp.where(tv, jnp.exp(log_w - w_max), 0.0)
    num = jnp.einsum("bhnt,bhtd->bnhd", weights, f)
    den = jnp.sum(weights, axis=-1).transpose(0, 2, 1)[..., None]
    return (num / jnp.where(den > 0, den, 1.0)).astype(q.dtype)


LARA = register(
    Mechanism(
        name="lara",
        init_fn=lara_init,
        attention_fn=lara_attention,
        reference_fn=lara_reference,
        supports_causal=False,
        stochastic=True,
        description="linear randomized attention, MIS over C landmark proposals (Zheng et al. "
        "2022), O(TC)",
    )
)

__all__ = [
    "ALPHA_FLOOR",
    "LARA",
    "lara_attention",
    "lara_init",
    "lara_noise",
    "lara_reference",
    "lara_sharded",
]
