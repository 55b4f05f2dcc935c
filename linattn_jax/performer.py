"""Performer: FAVOR+ positive orthogonal random features (Choromanski et al. 2021).

``phi(x) = M^(-1/2) (exp(W x^ - |x^|^2 / 2 - c) + eps)`` with ``x^ = x d^(-1/4)``
and W ``[M, d]`` stacked orthogonal blocks, so ``E[phi(q) . phi(k)] = exp(q.k /
sqrt(d))`` (up to the cancelling stabilisers and the small eps). The stabilisers
are detached maxima: per token for queries; for keys per token, then over the
visible keys by the core (`core.linear_attention`'s ``key_log_scale``: over all
unmasked keys when non-causal, a running max when causal); they cancel in the
attention ratio. The eps is relative to each token's largest feature.

Which W a call uses is the ``redraw`` policy (`core.REDRAW`): by default (``"never"``)
always ``params["features"]``, the init draw or the one a trainer's periodic redraw
(``redraw_every`` in `train`) stored; ``redraw="call"`` draws fresh features from `rng`
at every call with ``deterministic=False``. The public Performer-JAX code seeds its
"redraw" with the query's sum, which saturates to one of two fixed draws in training, and
performer-pytorch redraws every 1000 steps: both train on a kept draw, and a fresh kernel
every step keeps the model from learning Pathfinder (docs/random_features.md).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from linattn_jax import _checks, core
from linattn_jax.registry import Mechanism, register

#: Added to every positive feature (FAVOR+ numerical stabiliser).
FEATURE_EPS = 1e-6


def orthonormal_rows(a):
    """The rows of `a` ``[..., n, d]`` (n <= d) orthonormalised in order by Gram-Schmidt
    (each row projected out twice, which keeps them orthogonal to float32 rounding).

    The result is ``Q^T`` for the QR of ``a^T`` with a positive diagonal in R, so for a
    Gaussian `a` it is Haar-distributed. Written with matrix-vector products instead of
    LAPACK's batched QR: on the CPU, jaxlib's batched QR waits on XLA's own thread pool
    for its batch, and two of them running at once (the per-call redraw in two layers of
    a model) can deadlock a pool of two threads.
    """
    n = a.shape[-2]
    hi = lax.Precision.HIGHEST

    def body(i, q):  # rows >= i of q are still zero
        row = lax.dynamic_index_in_dim(a, i, axis=-2, keepdims=False)
        for _ in range(2):
            coef = jnp.einsum("...nd,...d->...n", q, row, precision=hi)
            row = row - jnp.einsum("...nd,...n->...d", q, coef, precision=hi)
        row = row * lax.rsqrt(jnp.sum(row * row, axis=-1, keepdims=True))
        return lax.dynamic_update_index_in_dim(q, row, i, axis=-2)

    return lax.fori_loop(0, n, body, jnp.zeros_like(a))


def orthogonal_features(rng, num_heads: int, num_features: int, head_dim: int):
    """Orthogonal random features ``[H, M, d]`` (float32).

    Each head stacks ``ceil(M / d)`` blocks of d orthonormal rows (Gram-Schmidt of a
    Gaussian d x d matrix, `orthonormal_rows`: Haar-distributed), truncated to M rows; row
    i is then rescaled by the norm of an independent ``N(0, I_d)`` vector, so each row is
    marginally ``N(0, I_d)`` and rows within a block are exactly orthogonal.
    """
    n_blocks = -(-num_features // head_dim)
    k_q, k_n = jax.random.split(rng)
    g = jax.random.normal(k_q, (num_heads, n_blocks, head_dim, head_dim), jnp.float32)
    # the rows of g^T: the same draw as the columns of g in the QR-based versions before
    rows = orthonormal_rows(jnp.swapaxes(g, -1, -2))
    rows = rows.reshape(num_heads, n_blocks * head_dim, head_dim)[:, :num_features]
    norms = jnp.linalg.norm(
        jax.random.normal(k_n, (num_heads, num_features, head_dim), jnp.float32), axis=-1
    )
    return rows * norms[..., None]


def init(
    rng, *, num_heads: int, head_dim: int, num_features: int = 256, shared_features: bool = True
):
    """``{"features": [H, M, d]}`` (``[1, M, d]`` with `shared_features`): the orthogonal
    features every call uses (with ``redraw="call"``, a sampling call redraws this shape).

    `shared_features` (the default) gives every head the same W, the layout of the public
    FAVOR+ code (one ``[M, d]`` projection matrix): one large matmul instead of H small
    ones, measured faster (`python -m train.bench scaling`). Each head's estimator is the
    same, unbiased with the same variance; the difference is across heads: with shared W
    the heads' errors are correlated, so they do not average out over the output
    projection as H independent draws (``shared_features=False``) would.
    """
    _checks.check_positive("performer", num_features=num_features)
    draws = 1 if shared_features else num_heads
    return {"features": orthogonal_features(rng, draws, num_features, head_dim)}


def feature_map(x, features, *, stabilize: bool = True):
    """FAVOR+ features, ``[B, T, H, d] -> ([B, T, H, M], [B, T, H])`` float32.

    Returns ``(phi, n)`` with the estimator's features ``exp(n) * phi``:
    ``phi = M^(-1/2) (exp(W x^ - |x^|^2 / 2 - n) + eps exp(top - n))`` with ``top`` the
    token's largest exponent (detached), so eps is relative to its largest feature, and
    ``n = top`` (0 when ``stabilize=False``, which gives the raw estimator features whose
    dot products estimate ``exp(q.k / sqrt(d))``). For
    queries n cancels in the attention ratio; for keys it is passed to the core as
    ``key_log_scale``, which stabilises it over the visible keys (a running max
    when causal, so no query depends on future keys).

    Args:
      x: queries or keys (unscaled).
      features: ``[H, M, d]`` random features W, or ``[1, M, d]`` shared by the heads.
      stabilize: subtract the per-token max.
    """
    # computed heads first ([B, H, T, .]: the input, d wide, is transposed instead of the
    # M-wide features; `core.heads_last` hands them back in the core's layout)
    xs = core.scale_inputs(x)
    xh = jnp.swapaxes(xs, 1, 2)
    w = features.astype(jnp.float32)
    if w.shape[0] == 1:  # shared by the heads: one [B H T, d] x [d, M] matmul
        wx = jnp.einsum("bhtd,md->bhtm", xh, w[0])
    else:
        wx = jnp.einsum("bhtd,hmd->bhtm", xh, w)
    # from x as given (a second reading of the transposed xh costs XLA a second transpose)
    half_sq = jnp.swapaxes(0.5 * core.rowdot(xs, xs), 1, 2)  # [B, H, T]
    top = lax.stop_gradient(jnp.max(wx, axis=-1) - half_sq)  # each token's largest exponent
    n = top if stabilize else jnp.zeros_like(top)
    m = features.shape[1]
    # Every per-token term is folded into a [B, H, T] array before it meets the M-wide
    # projection, so the M-wide expression holds no scalar constant: XLA's CPU fusion of a
    # matmul with its elementwise consumers materialises each constant it meets at the full
    # [B, H, T, M] shape (two 64 MB buffers a call at T = 16k, about 20% of the forward).
    shift = half_sq + n + 0.5 * math.log(m)  # the 1/sqrt(M) as a log
    # the eps is relative to the token's largest feature, exp(top - n) / sqrt(M) (detached:
    # a constant offset, as before)
    eps = FEATURE_EPS * m**-0.5 * jnp.exp(top - n)
    phi = jnp.exp(wx - shift[..., None]) + eps[..., None]
    return core.heads_last(phi), core.heads_last(n)


def _query(q, params):
    return feature_map(q, lax.stop_gradient(params["features"]))[0]


def _key(k, params):
    return core.KeyFeatures(*feature_map(k, lax.stop_gradient(params["features"])))


def _draw(params, rng, *, redraw="never"):
    """A fresh draw of the same size under ``redraw="call"``, else `params` itself."""
    if redraw != "call":
        return params
    h, m, d = params["features"].shape
    return {**params, "features": orthogonal_features(rng, h, m, d)}


#: Queries ``phi``; keys ``(phi, n)`` with n the per-token log-scale (see `feature_map`).
FEATURE_MAP = core.FeatureMap(query_fn=_query, key_fn=_key, draw_fn=_draw, token_wise=True)


def _attend(q, k, v, params, rng, mask, causal, deterministic, chunk_size, redraw, quadratic):
    _checks.check_inputs("performer", q, k, v, mask, causal=causal)
    _checks.check_positive("performer", chunk_size=chunk_size)
    core.check_redraw("performer", redraw)
    _checks.check_rng("performer", rng, not core.redraws(redraw, deterministic))
    _checks.require_params("performer", params, "features")
    w = params["features"]
    h, d = q.shape[2], q.shape[3]
    if w.ndim != 3 or w.shape[0] not in (1, h) or w.shape[2] != d:
        raise ValueError(
            f"performer: params['features'] has shape {w.shape}, expected [H={h}, M, d={d}] "
            f"or [1, M, d={d}] (shared by the heads)"
        )
    return core.attend_features(
        FEATURE_MAP,
        q,
        k,
        v,
        params,
        rng,
        mask=mask,
        causal=causal,
        deterministic=deterministic,
        chunk_size=chunk_size,
        quadratic=quadratic,
        redraw=redraw,
    )


def attention(
    q,
    k,
    v,
    params,
    rng=None,
    *,
    mask=None,
    causal=False,
    deterministic=False,
    chunk_size=64,
    redraw="never",
):
    """FAVOR+ attention ``[B, Tq, H, Dv]``.

    Uses ``params["features"]``, unless ``redraw="call"`` and ``deterministic=False``: then
    a fresh set of orthogonal features (same M) is drawn from `rng` (required then).
    """
    return _attend(q, k, v, params, rng, mask, causal, deterministic, chunk_size, redraw, False)


def reference(
    q,
    k,
    v,
    params,
    rng=None,
    *,
    mask=None,
    causal=False,
    deterministic=False,
    chunk_size=64,
    redraw="never",
):
    """The naive quadratic form of `attention` (same features)."""
    return _attend(q, k, v, params, rng, mask, causal, deterministic, chunk_size, redraw, True)


MECHANISM = register(
    Mechanism(
        name="performer",
        init_fn=init,
        attention_fn=attention,
        reference_fn=reference,
        supports_causal=True,
        stochastic=False,
        stochastic_fn=lambda *, redraw="never": redraw == "call",
        fixed_fn=lambda: frozenset({"features"}),
        feature_map_spec=FEATURE_MAP,
        params_config_fn=lambda params: {"num_features": params["features"].shape[1]},
        description="FAVOR+ positive orthogonal random features (Choromanski et al. 2021), O(T)",
    )
)
