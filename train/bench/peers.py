"""Peer implementations for ``python -m train.bench scaling``: the speed a mechanism should beat.

A peer is a stand-in for a mechanism's public code, written in ``jax.numpy``: it follows that
code's structure and numerics (what it computes, its layout, its stabilisers, its causal
algorithm and backward, its sampler) and leaves out what the benchmark does not time (the
input and output projections, masks, dropout, options off by default). Each peer's
docstring names its source and lists the differences that remain; `tests/test_bench_peers.py`
checks each against a naive implementation of the public algorithm on the same inputs and
the same random draws. ``scaling`` times each registered mechanism's peer beside it, in the
same process and on the same inputs, as a row ``<name>_peer``, and prints a table of
``speed vs peer = peer time / our time`` (> 1: ours is faster).

* ``performer_peer``: google-research ``performer/fast_attention/jax/fast_attention.py``
  (``make_fast_softmax_attention`` with its defaults), JAX.
* ``lara_peer``: HKUNLP ``efficient-attention`` ``LinearRA`` (its defaults), PyTorch.
* ``ra_peer``: HKUNLP ``efficient-attention`` ``RandomizedAttention`` (its default), PyTorch.

Peers that train in our models (``python -m train.bench equivalence``) are in
`train.bench.training_peers`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from train.bench import common

# ----------------------------------------------------------------------------- LARA / RA


def _heads_first(*xs):
    """The official ``proj_and_split_heads``: ``[B, T, H, D] -> [B, H, T, D]``."""
    return tuple(jnp.swapaxes(x, 1, 2) for x in xs)


def _prm(x, w):
    """Official ``prm_projection(x, w, normalize=False)``: ``[B,H,T,D], [B,H,C,D] -> [B,H,C,T]``."""
    s = x.shape[-1] ** -0.5
    return jnp.einsum("bhcd,bhnd->bhcn", w, x * s) - s * jnp.sum(x**2, -1)[:, :, None, :] / 2.0


def _segment_means(x, c):
    """The official 1-D landmarks (``_proposal_gen_1d``): the tokens themselves when T <= C,
    reshape-and-mean when C divides T, else the first landmarks over T // C tokens and the
    rest over T // C + 1."""
    b, h, n, d = x.shape
    if n <= c:
        return x
    if n % c == 0:
        return x.reshape(b, h, c, n // c, d).mean(-2)
    segs = n // c
    num_k = (segs + 1) * c - n
    first = x[:, :, : num_k * segs].reshape(b, h, num_k, segs, d).mean(-2)
    last = x[:, :, num_k * segs :].reshape(b, h, c - num_k, segs + 1, d).mean(-2)
    return jnp.concatenate([first, last], axis=2)


def _adaptive_avg_pool(x, image, s):
    """torch ``AdaptiveAvgPool2d(s)`` of the row-major ``image = (H, W)`` tokens of ``x [B,
    H, T, D]`` then ``flatten(2).transpose``: ``[B, H, s * s, D]``, cell i of an axis of size
    n averaging ``[floor(i n / s), ceil((i + 1) n / s))`` (bins overlap when s does not
    divide n)."""
    b, h, _, d = x.shape
    img = x.reshape(b, h, image[0], image[1], d)

    def bins(n):
        return [(i * n // s, -(-(i + 1) * n // s)) for i in range(s)]

    rows = [img[:, :, r0:r1].mean(2) for r0, r1 in bins(image[0])]  # [B, H, W, D] each
    return jnp.stack([r[:, :, c0:c1].mean(2) for r in rows for c0, c1 in bins(image[1])], 2)


def pool_init(key, d: int):
    """The official pool network's init for one side: ``Linear(d, d)`` (weight ``[out, in]``
    drawn ``N(0, 0.02^2)``, the timm ``trunc_normal_`` whose +-2 bounds are 100 std away;
    bias 0) and ``LayerNorm(d)`` (scale 1, shift 0)."""
    return (0.02 * jax.random.normal(key, (d, d)), jnp.zeros(d), jnp.ones(d), jnp.zeros(d))


def _pool_net(x, params):
    """``LayerNorm(Linear(x))`` over the last axis (torch's LayerNorm: biased variance, eps
    1e-5), one network shared by the heads (the official ``"light"`` module)."""
    w, bias, scale, shift = params
    bias, scale, shift = (p[None, None, None] for p in (bias, scale, shift))  # [1, 1, 1, d]
    y = jnp.einsum("bhcd,ed->bhce", x, w) + bias
    mean = y.mean(-1, keepdims=True)
    var = jnp.square(y - mean).mean(-1, keepdims=True)
    return (y - mean) / jnp.sqrt(var + 1e-5) * scale + shift


def lara_peer(
    q,
    k,
    v,
    rng,
    *,
    num_landmarks: int = 64,
    alpha_coeff: float = 1.0,
    eps=None,
    image: tuple[int, int] | None = None,
    pool_params=None,
):
    """The official LARA: ``q, k, v [B, T, H, D]`` -> ``[B, T, H, D]``.

    Source: HKUNLP ``efficient-attention``, ``efficient_attention/lara.py``, ``LinearRA``
    with its defaults (``proposal_gen="pool"``, ``mis_type="mis-opt"``, ``alpha_coeff=1``,
    no antithetics, no multisample) in training mode (one noisy sample per proposal).

    The default proposal ``"pool"`` on a 1-D sequence: ``_proposal_gen_1d`` applies a
    network only for ``"adaptive-1d"``; for ``"pool"`` (whose AdaptiveAvgPool2d + Linear +
    LayerNorm the module builds but uses only in ``_proposal_gen_2d``, on images) the
    landmarks are the segment means of the unscaled q, k (`_segment_means`). So the official
    default is our ``proposal="mean"`` on sequences, which is what ``scaling`` times. On an
    image (`image`, the ``"light"`` pool module): ``q~ = LayerNorm(Linear(AdaptiveAvgPool2d(
    sqrt(C))(q)))`` per head, the network shared by the heads, one per side (`pool_params`);
    our ``proposal="pool"`` with ``grid=image``, ``mixed=False`` (theirs: no ``-mixed``).

    Structure followed: heads-first ``[B, H, T, D]`` (the official head split, and back by
    its merge); landmarks q~, k~ by reshape-and-mean; ``mu = q~ + k~`` and the sample
    ``w = mu + N(0, I)`` in the unscaled space; every log-density by ``prm_projection``
    (``w . x / sqrt(d) - |x|^2 / (2 sqrt(d))``) in the ``[B, H, C, T]`` proposal-major
    layout; ``kv_stats = softmax_T(log_proj_k) v``; mis-opt's ``t_nc = softmax_T(q~ . q /
    sqrt(d))``, balance heuristic from the diagonal of ``prm(mu, w)``, ``alpha = bh +
    alpha_coeff (t_nc - mean_c t_nc)`` clamped at 1e-8 before the log; self-normalised
    weights by a softmax over the C proposals.

    Differences that remain: no qkv and output projections, no key padding mask, no dropout
    (the bench times the attention core of every mechanism alone); float32 only; jax's
    normal sampler, not torch's; a function traced by ``jax.jit``, not PyTorch eager.

    Args:
      rng: key of the unit noise (``jax.random.normal`` of mu's shape).
      eps: optional unit noise ``[B, H, C, D]`` in place of the draw from `rng`.
      image: None (a sequence) or ``(H, W)`` with ``H W = T``: the tokens are that image in
        row-major order, pooled to ``isqrt(num_landmarks)`` squared landmarks.
      pool_params: with `image`, ``{"q": p, "k": p}`` with each p a `pool_init` tuple
        ``(weight [out, in], bias, ln_scale, ln_shift)``; None: `pool_init` of keys 0 and 1.
    """
    q, k, v = _heads_first(q, k, v)
    b, h, n, d = q.shape
    scale = d**-0.5
    if image is None:
        q_bar, k_bar = _segment_means(q, num_landmarks), _segment_means(k, num_landmarks)
    else:
        if image[0] * image[1] != n:
            raise ValueError(f"lara_peer: image={image} must have H * W = T = {n}")
        if pool_params is None:
            pool_params = {s: pool_init(jax.random.key(i), d) for i, s in enumerate("qk")}
        side = int(num_landmarks**0.5)
        q_bar = _pool_net(_adaptive_avg_pool(q, image, side), pool_params["q"])
        k_bar = _pool_net(_adaptive_avg_pool(k, image, side), pool_params["k"])
    mu = q_bar + k_bar
    w = mu + (jax.random.normal(rng, mu.shape, mu.dtype) if eps is None else eps)
    log_proj_q = _prm(q, w)  # [B, H, C, T]
    log_proj_k = _prm(k, w)
    kv_stats = jnp.einsum("bhcm,bhmd->bhcd", jax.nn.softmax(log_proj_k, -1), v)  # [B, H, C, D]
    t_nc = jax.nn.softmax(jnp.einsum("bhcd,bhnd->bhcn", scale * q_bar, q), -1)
    log_proj_mu = _prm(mu, w)  # [B, H, C, C]
    log_proposal = jnp.diagonal(log_proj_mu, axis1=-1, axis2=-2)[..., None]  # [B, H, C, 1]
    bh = jnp.exp(log_proposal - jax.nn.logsumexp(log_proj_mu, -1, keepdims=True))
    alpha = bh + alpha_coeff * (t_nc - t_nc.mean(-2, keepdims=True))
    log_alpha = jnp.log(jnp.maximum(alpha, 1e-8))
    log_true = log_proj_q + jax.nn.logsumexp(log_proj_k, -1, keepdims=True)
    sniw = jax.nn.softmax(log_alpha + log_true - log_proposal, axis=-2)  # [B, H, C, T]
    out = jnp.einsum("bhcn,bhcd->bhnd", sniw, kv_stats)
    return jnp.swapaxes(out, 1, 2)  # the official head merge


def ra_peer(q, k, v, rng, *, draws=None):
    """The official RA: ``q, k, v [B, T, H, D]`` -> ``[B, T, H, D]``. Quadratic.

    Source: HKUNLP ``efficient-attention``, ``efficient_attention/randomized_attention.py``,
    ``RandomizedAttention._apply_attention`` with its default ``num_samples=1``, in training
    mode. Non-causal only (the official module has no causal form).

    Structure followed: heads-first ``[B, H, T, D]``; ``pi = softmax_m(q . k_m / sqrt(d))``
    as a ``[B, H, T, T]`` array; one key index per query drawn from pi with no gradient by
    ``torch.multinomial(pi, 1, replacement=True)``, whose one-sample path is ``argmax(pi /
    E)`` with ``E ~ Exp(1)`` of pi's shape (PyTorch ``aten/src/ATen/native/Distributions.cpp``),
    done here the same way; the chosen key gathered (``take_along_dim``; its gradient reaches
    k); ``w = q + k_m* + N(0, I)`` in the unscaled space (so its noise is ``d^(-1/4)`` in the
    scaled space, not the paper's unit noise); ``softmax_m(w . k_m / sqrt(d) - |k_m|^2 /
    (2 sqrt(d))) v``.

    Differences that remain: no qkv and output projections, no key padding mask (unused by
    the official RA), no dropout; float32 only; jax's samplers, not torch's; traced by
    ``jax.jit``, not PyTorch eager.

    Args:
      rng: key of the draws (split in two: the exponentials and the noise).
      draws: optional ``(e [B, H, T, T] > 0, eps [B, H, T, D])`` in place of the draws.
    """
    q, k, v = _heads_first(q, k, v)
    d = q.shape[-1]
    scale = d**-0.5
    pi = jax.nn.softmax(jnp.einsum("bhnd,bhmd->bhnm", scale * q, k), -1)  # [B, H, T, T]
    if draws is None:
        k_e, k_n = jax.random.split(rng)
        draws = (jax.random.exponential(k_e, pi.shape), jax.random.normal(k_n, q.shape))
    e, eps = draws
    k_ind = jnp.argmax(lax.stop_gradient(pi) / e, axis=-1)  # [B, H, T]
    k_prime = jnp.take_along_axis(k, k_ind[..., None], axis=-2)  # [B, H, T, D]
    w = q + k_prime + eps
    data_dash = jnp.einsum("bhnd,bhmd->bhnm", w, scale * k)
    norm = scale * jnp.sum(k**2, -1)[:, :, None, :] / 2.0  # [B, H, 1, T]
    out = jnp.einsum("bhnm,bhmd->bhnd", jax.nn.softmax(data_dash - norm, -1), v)
    return jnp.swapaxes(out, 1, 2)


# ----------------------------------------------------------------------------- FAVOR+


def orthogonal_projection(key, m: int, d: int):
    """The public ``GaussianOrthogonalRandomMatrix(m, d, key, scaling=0)``: ``[M, d]``.

    Full d x d blocks then a partial one, each the transposed Q of a QR of a Gaussian block
    drawn from the next split of `key`; rows scaled by the norms of an ``[M, d]`` Gaussian
    drawn from `key` itself, by a product with ``diag(norms)`` as theirs.
    """
    blocks = []
    rng = key
    for rows in [d] * (m // d) + ([m % d] if m % d else []):
        rng, sub = jax.random.split(rng)
        blocks.append(jnp.linalg.qr(jax.random.normal(sub, (d, d)))[0].T[:rows])
    norms = jnp.linalg.norm(jax.random.normal(key, (m, d)), axis=1)
    return jnp.matmul(jnp.diag(norms), jnp.concatenate(blocks, axis=0))


def projection_from_key(key, m: int, d: int):
    """The public ``draw_weights(key)``: the matrix from the first half of a split of `key`."""
    return orthogonal_projection(jax.random.split(key)[0], m, d)


def query_seed_key(q):
    """The public redraw's key: seeded by ``ceil(sum(query) * 1e7)`` cast to int32."""
    return jax.random.key(lax.convert_element_type(jnp.ceil(jnp.sum(q) * 10000000.0), jnp.int32))


def _favor_features(x, w, *, is_query: bool, eps: float):
    """Public ``nonnegative_softmax_kernel_feature_creator``: ``x [B, H, T, d]`` -> ``[B, H,
    T, M]``; the max (over the features of a query; over all keys and features of a key) is
    subtracted without a stop_gradient, `eps` added inside the ``1/sqrt(M)`` factor."""
    normalizer = x.shape[-1] ** -0.25
    ratio = w.shape[0] ** -0.5
    thick = jnp.zeros(x.shape[:2] + w.shape, x.dtype) + w[None, None]  # [B, H, M, d]
    dash = jnp.einsum("bhtd,bhmd->bhtm", normalizer * x, thick)
    diag = (jnp.sum(jnp.square(x), axis=-1) / 2.0) * normalizer * normalizer
    axes = (3,) if is_query else (3, 2)
    return ratio * (jnp.exp(dash - diag[..., None] - jnp.max(dash, axis=axes, keepdims=True)) + eps)


def _numerator_fwd(qs, ks, vs):
    """Public ``_numerator`` forward: prefix sums ``S_t = sum_{s<=t} k_s v_s^T`` by a scan
    over positions, ``W_t = q_t S_t``; residuals: the final S and the inputs."""

    def body(s, qkv):
        q, k, v = qkv
        s = s + jnp.einsum("...m,...d->...md", k, v)
        return s, jnp.einsum("...m,...md->...d", q, s)

    s0 = jnp.zeros(ks.shape[1:] + vs.shape[-1:], vs.dtype)  # [B, H, M, D]
    s, out = lax.scan(body, s0, (qs, ks, vs))
    return out, (s, qs, ks, vs)


def _numerator_bwd(res, out_ct):
    """Public ``_numerator`` backward: a reverse scan that recovers each S_t from the final S
    by subtraction and carries the cotangent of S."""

    def body(carry, qkvc):
        s, s_ct = carry
        q, k, v, ct = qkvc
        q_ct = jnp.einsum("...d,...md->...m", ct, s)
        s_ct = s_ct + jnp.einsum("...d,...m->...md", ct, q)
        k_ct = jnp.einsum("...md,...d->...m", s_ct, v)
        v_ct = jnp.einsum("...md,...m->...d", s_ct, k)
        s = s - jnp.einsum("...m,...d->...md", k, v)
        return (s, s_ct), (q_ct, k_ct, v_ct)

    s, qs, ks, vs = res
    _, cts = lax.scan(body, (s, jnp.zeros_like(s)), (qs, ks, vs, out_ct), reverse=True)
    return cts


@jax.custom_vjp
def _numerator(qs, ks, vs):
    """``[T, B, H, M], [T, B, H, M], [T, B, H, D] -> [T, B, H, D]``: causal ``Q' (K'^T V)``."""
    return _numerator_fwd(qs, ks, vs)[0]


_numerator.defvjp(_numerator_fwd, _numerator_bwd)


def _denominator_fwd(qs, ks):
    """Public ``_denominator`` forward: ``R_t = q_t . sum_{s<=t} k_s`` by a second scan."""

    def body(z, qk):
        q, k = qk
        z = z + k
        return z, jnp.einsum("...m,...m->...", q, z)

    z, out = lax.scan(body, jnp.zeros(ks.shape[1:], ks.dtype), (qs, ks))
    return out, (qs, ks, z)


def _denominator_bwd(res, out_ct):
    """Public ``_denominator`` backward: reverse scan, prefix sum recovered by subtraction."""

    def body(carry, qkc):
        z, z_ct = carry
        q, k, ct = qkc
        q_ct = jnp.einsum("...,...m->...m", ct, z)
        z_ct = z_ct + jnp.einsum("...,...m->...m", ct, q)
        return (z - k, z_ct), (q_ct, z_ct)

    qs, ks, z = res
    _, cts = lax.scan(body, (z, jnp.zeros_like(z)), (qs, ks, out_ct), reverse=True)
    return cts


@jax.custom_vjp
def _denominator(qs, ks):
    """``[T, B, H, M], [T, B, H, M] -> [T, B, H]``: causal ``Q' (K'^T 1)``."""
    return _denominator_fwd(qs, ks)[0]


_denominator.defvjp(_denominator_fwd, _denominator_bwd)


def performer_peer(
    q,
    k,
    v,
    rng=None,
    *,
    num_features: int = 256,
    causal: bool = False,
    stabilizer: float = 1e-6,
    projection=None,
):
    """The public JAX FAVOR+: ``q, k, v [B, T, H, D]`` -> ``[B, T, H, D]``.

    Source: google-research ``performer/fast_attention/jax/fast_attention.py``,
    ``make_fast_softmax_attention(qkv_dim, nb_features=M)`` with its defaults (orthogonal
    features, ``ortho_scaling=0``, nonnegative features, ``renormalize_attention=True``,
    ``numerical_stabilizer=1e-6``, ``redraw_features=True``, ``lax_scan_unroll=1``;
    ``unidirectional`` = `causal`), one attention axis.

    Structure followed:

    * the projection: one ``[M, d]`` Gaussian orthogonal matrix (QR blocks, rows scaled by
      Gaussian norms) shared by the batch and the heads, redrawn per call from a key seeded
      by the query's sum (`query_seed_key`, `projection_from_key`);
    * layout: q, k, v transposed to heads-first ``[B, H, T, d]`` (their ``qk_perm``: batch
      dims, attention axis, channels), the projection broadcast to ``[B, H, M, d]`` and met
      by a batched product, features ``[B, H, T, M]``; the output transposed back;
    * features: ``(exp(x w / d^(1/4) - |x|^2 / (2 sqrt(d)) - max) + eps) / sqrt(M)``, the
      max over a query's features or over all keys and features of a (batch, head), with no
      stop_gradient (its gradient is taken);
    * non-causal: ``Z = K'^T V``, ``W = Q' Z``, ``R = Q' (K'^T 1)`` (by a product with a
      ones array, as theirs);
    * causal: features moved length-first ``[T, B, H, M]`` for two ``lax.scan`` s over
      positions, the numerator ``W`` and the denominator ``R``, each a ``jax.custom_vjp``
      whose backward is a reverse scan that recovers the prefix sums by subtraction;
    * the denominator: ``R + 2 eps [|R| <= eps]``, its reciprocal times W.

    Differences that remain: the projection is drawn from `rng` when given (the bench passes
    None: the public query seed) or taken as `projection`; no bias, mask or dropout (the
    public function asserts or ignores them in this configuration); float32 only; one
    attention axis; a function, not a method that stores the matrix on ``self``.

    Args:
      rng: None (the public redraw, seeded by the query) or the key of `projection_from_key`.
      num_features: M, rows of the projection.
      causal: the public ``unidirectional``.
      stabilizer: the public ``numerical_stabilizer``, added to every feature and guarding
        the denominator.
      projection: optional ``[M, d]`` matrix used as is (the test's shared random features).
    """
    d = q.shape[-1]
    if projection is None:
        key = query_seed_key(q) if rng is None else rng
        projection = projection_from_key(key, num_features, d)
    q, k, v = (jnp.transpose(x, (0, 2, 1, 3)) for x in (q, k, v))  # [B, H, T, d]
    qp = _favor_features(q, projection, is_query=True, eps=stabilizer)  # [B, H, T, M]
    kp = _favor_features(k, projection, is_query=False, eps=stabilizer)
    if causal:
        w = _numerator(*(jnp.moveaxis(x, 2, 0) for x in (qp, kp, v)))  # [T, B, H, D]
        w = jnp.moveaxis(w, 0, 2)
        r = jnp.moveaxis(_denominator(jnp.moveaxis(qp, 2, 0), jnp.moveaxis(kp, 2, 0)), 0, 2)
    else:
        z = jnp.einsum("bhtm,bhtd->bhmd", kp, v)
        w = jnp.einsum("bhtm,bhmd->bhtd", qp, z)
        ones = jnp.zeros(k.shape[:-1], k.dtype) + jnp.ones(k.shape[2:3], k.dtype)[None, None]
        r = jnp.einsum("bhtm,bhm->bht", qp, jnp.einsum("bhtm,bht->bhm", kp, ones))
    r = r + 2 * stabilizer * (jnp.abs(r) <= stabilizer)
    out = w * jnp.reciprocal(r)[..., None]  # [B, H, T, D]
    return jnp.transpose(out, (0, 2, 1, 3))


# ----------------------------------------------------------------------------- the bench


class Peer(NamedTuple):
    """A registered peer: `fn(q, k, v, rng, **config)`; `causal`: it has a causal form
    (timed in both modes, else non-causal only); `rng`: whether it gets the bench's key
    (False: it draws as the public code does, from its inputs)."""

    fn: Callable
    config: dict
    causal: bool = False
    rng: bool = True


#: name -> the peer of that registry mechanism, with the config of its bench row (the
#: mechanism's defaults: 64 landmarks, 256 features, one RA sample).
PEERS: dict[str, Peer] = {
    "lara": Peer(lara_peer, {"num_landmarks": 64}),
    "performer": Peer(performer_peer, {"num_features": 256}, causal=True, rng=False),
    "ra": Peer(ra_peer, {}),
}


def peer_name(name: str) -> str:
    return f"{name}_peer"


def peer_names(names) -> list[str]:
    """`names` with each peer row right after its mechanism."""
    out = []
    for n in names:
        out.append(n)
        if n in PEERS:
            out.append(peer_name(n))
    return out


def peer_points(name: str, cfg, emit=None, series=None) -> list[dict]:
    """Times `name`'s peer (if any) at every T, mode and pass of `cfg` (causal only for a
    peer with a causal form).

    Same inputs, pass definitions (forward; loss ``<out, ct>`` and its gradient w.r.t. q, k,
    v) and timing as the mechanism's own points; `series`: a fresh
    `train.bench.scaling.Series` that measures each point and skips it as the mechanism's
    own are skipped (memory budget, predicted time).
    """
    peer = PEERS.get(name)
    modes = [m for m in cfg.modes if m == "noncausal" or (peer is not None and peer.causal)]
    if peer is None or not modes:
        return []
    points = []
    for seq_len, mode, pass_ in itertools.product(cfg.seq_lens, modes, cfg.passes):
        q, k, v, ct = common.random_qkv(cfg.batch, seq_len, cfg.heads, cfg.head_dim)
        rng = jax.random.key(1) if peer.rng else None
        extra = {"causal": True} if mode == "causal" else {}

        def fwd(q, k, v, extra=extra, rng=rng):
            return peer.fn(q, k, v, rng, **peer.config, **extra)

        f, args = (fwd, (q, k, v))
        if pass_ == "fwd_bwd":
            f, args = common.fwd_bwd(fwd, argnums=(0, 1, 2)), (*args, ct)
        point = {
            "mechanism": peer_name(name),
            "peer_of": name,
            "seq_len": seq_len,
            "mode": mode,
            "pass": pass_,
            "quadratic": series.quadratic,
        }
        points.append(series.run(point, f, args, emit))
    return points


def add_peer_ratios(points: list[dict]) -> list[dict]:
    """Sets ``speed_vs_peer = peer time / our time`` on each mechanism point that has a peer."""
    index = {
        (p["mechanism"], p["seq_len"], p["mode"], p["pass"]): p for p in points if "seq_len" in p
    }
    for p in points:
        if "seq_len" not in p or p["mechanism"] not in PEERS:
            continue
        peer = index.get((peer_name(p["mechanism"]), p["seq_len"], p["mode"], p["pass"]))
        if peer and peer.get("time_ms") and p.get("time_ms"):
            p["speed_vs_peer"] = peer["time_ms"] / p["time_ms"]
    return points


def peer_table(result: dict) -> str:
    """Markdown: per mechanism with a peer, our time, the peer's, and the speed ratio."""
    rows = [p for p in result["points"] if "speed_vs_peer" in p]
    if not rows:
        return ""
    out = [
        "\n#### speed vs peer (jnp stand-ins of the public code, train/bench/peers.py; "
        "> 1: ours faster)\n",
        "| mechanism | T | mode | pass | ours | peer | speed vs peer |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    for p in sorted(rows, key=lambda r: (r["mechanism"], r["mode"], r["pass"], r["seq_len"])):
        peer_ms = p["time_ms"] * p["speed_vs_peer"]
        out.append(
            f"| {p['mechanism']} | {p['seq_len']} | {p['mode']} | {p['pass']} | "
            f"{p['time_ms']:.1f} ms | {peer_ms:.1f} ms | {p['speed_vs_peer']:.2f}x |"
        )
    return "\n".join(out) + "\n"


__all__ = [
    "PEERS",
    "Peer",
    "add_peer_ratios",
    "lara_peer",
    "peer_names",
    "peer_points",
    "peer_table",
    "performer_peer",
    "pool_init",
    "orthogonal_projection",
    "projection_from_key",
    "query_seed_key",
    "ra_peer",
]
