"""`train.bench.peers`: each stand-in computes its public algorithm, checked against a naive
implementation written here (quadratic forms, loops in float64) on the same inputs and the
same random draws; performer's causal path also in its gradients (its hand-written backward)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linattn_jax import lara
from train.bench import peers


def _qkv(b, t, h, d, scale=1.0):
    return tuple(
        jnp.asarray(scale * np.random.default_rng(i).standard_normal((b, t, h, d)), jnp.float32)
        for i in range(3)
    )


# ----------------------------------------------------------------------------- performer


def _favor_reference(q, k, v, w, *, causal, stabilizer):
    """FAVOR+ as the public code defines it, as a quadratic form: ``A = phi(q) phi(k)^T``
    (causal: lower triangle), ``out = A v / guard(A 1)``; phi with the public stabilisers
    (max of ``x w / d^(1/4)`` over a query's features, over all keys and features of a key;
    not detached) and ``guard(r) = r + 2 eps [|r| <= eps]``."""
    d, m = q.shape[-1], w.shape[0]

    def phi(x, axes):
        xs = x * d**-0.25
        dash = jnp.einsum("bthd,md->bhtm", xs, w)
        sq = 0.5 * jnp.einsum("bthd,bthd->bht", xs, xs)[..., None]
        return (jnp.exp(dash - sq - jnp.max(dash, axis=axes, keepdims=True)) + stabilizer) / (
            m**0.5
        )

    a = jnp.einsum("bhim,bhjm->bhij", phi(q, (3,)), phi(k, (2, 3)))  # [B, H, T, T]
    if causal:
        a = a * jnp.tril(jnp.ones(a.shape[-2:], a.dtype))[None, None]
    den = jnp.sum(a, axis=-1)
    den = den + 2 * stabilizer * (jnp.abs(den) <= stabilizer)
    return jnp.einsum("bhij,bjhd->bihd", a, v) / jnp.transpose(den, (0, 2, 1))[..., None]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("stabilizer", [1e-6, 0.1])
def test_performer_peer_is_the_public_favor_with_the_same_projection(causal, stabilizer):
    """Forward and gradients against the quadratic form. Causal: the peer's two scans with
    their hand-written backward (reverse scans that recover the prefix sums by subtraction);
    stabilizer 0.1 makes the stabilisers and the gradient through the maxes count."""
    b, t, h, d, m = 2, 12, 2, 8, 12  # M = d + 4: a full orthogonal block and a partial one
    q, k, v = _qkv(b, t, h, d)
    ct = jnp.asarray(np.random.default_rng(9).standard_normal((b, t, h, d)), jnp.float32)
    w = peers.projection_from_key(jax.random.key(3), m, d)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * ct)

    def peer(q, k, v):
        return peers.performer_peer(
            q, k, v, num_features=m, causal=causal, stabilizer=stabilizer, projection=w
        )

    def ref(q, k, v):
        return _favor_reference(q, k, v, w, causal=causal, stabilizer=stabilizer)

    np.testing.assert_allclose(peer(q, k, v), ref(q, k, v), rtol=1e-5, atol=1e-5)
    got = jax.grad(loss(peer), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    for g, r, name in zip(got, want, "qkv", strict=True):
        # atol: the causal backward recovers each prefix sum from the last by subtraction,
        # a float32 drift of ~1e-5 of the gradient's scale (here O(1)).
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=5e-5, err_msg=name)
    prims = {e.primitive.name for e in jax.make_jaxpr(peer)(q, k, v).jaxpr.eqns}
    assert ("custom_vjp_call" in prims) == causal  # the causal path is the hand-written one


def test_performer_peer_projection_is_the_public_orthogonal_matrix():
    """Rows in blocks of d orthogonal directions (the last block partial), scaled by the norms
    of a Gaussian drawn from the same key; with no rng the projection is redrawn per call from
    the query's sum, so the same q gives the same output and another q another one."""
    m, d = 12, 8
    key = jax.random.key(5)
    w = np.asarray(peers.orthogonal_projection(key, m, d), np.float64)
    norms = np.linalg.norm(np.asarray(jax.random.normal(key, (m, d))), axis=1)
    np.testing.assert_allclose(np.linalg.norm(w, axis=1), norms, rtol=1e-5)
    u = w / norms[:, None]
    np.testing.assert_allclose(u[:d] @ u[:d].T, np.eye(d), atol=1e-5)
    np.testing.assert_allclose(u[d:] @ u[d:].T, np.eye(m - d), atol=1e-5)
    q, k, v = _qkv(1, 6, 2, d)
    out = peers.performer_peer(q, k, v, num_features=m)
    w_q = peers.projection_from_key(peers.query_seed_key(q), m, d)
    np.testing.assert_array_equal(
        out, peers.performer_peer(q, k, v, num_features=m, projection=w_q)
    )
    other = peers.performer_peer(q + 1.0, k, v, num_features=m)
    other_ref = peers.performer_peer(q + 1.0, k, v, num_features=m, projection=w_q)
    assert not np.allclose(other, other_ref)  # a new query, a new projection


def test_performer_peer_is_our_performer_with_the_same_features(monkeypatch):
    """The same estimator as our performer with the peer's projection as its shared features,
    non-causal and causal. Both add a small term to every feature after different stabilisers
    (theirs: the max over all keys, so a small key's features get relatively more): that term
    is turned off on both sides for the comparison."""
    import linattn_jax as la
    from linattn_jax import performer

    monkeypatch.setattr(performer, "FEATURE_EPS", 0.0)
    b, t, h, d, m = 2, 10, 3, 8, 16
    q, k, v = _qkv(b, t, h, d)
    w = peers.projection_from_key(jax.random.key(0), m, d)
    mech = la.get("performer")
    for causal in (False, True):
        peer = peers.performer_peer(
            q, k, v, num_features=m, causal=causal, stabilizer=0.0, projection=w
        )
        ours = mech.attention(q, k, v, {"features": w[None]}, causal=causal, deterministic=True)
        np.testing.assert_allclose(peer, ours, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- LARA


def _official_landmarks(x, c):
    """``[T, d] -> [C, d]``: the first ``(T // C + 1) C - T`` landmarks average T // C tokens,
    the rest T // C + 1 (T <= C: the tokens)."""
    t = x.shape[0]
    if t <= c:
        return x
    sizes = [t // c] * ((t // c + 1) * c - t)
    sizes += [t // c + 1] * (c - len(sizes))
    ends = np.cumsum(sizes)
    return np.stack([x[e - s : e].mean(0) for s, e in zip(sizes, ends, strict=True)])


def _pooled_landmarks(x, image, s, params):
    """``[T, d] -> [s * s, d]``: each cell the mean of its rectangle of the row-major image
    (torch's adaptive bins: ``[floor(i n / s), ceil((i + 1) n / s))``), then LayerNorm of
    the Linear map (weight ``[out, in]``)."""
    img = x.reshape(*image, -1)
    lo = [[(i * n) // s for i in range(s)] for n in image]
    hi = [[-((-(i + 1) * n) // s) for i in range(s)] for n in image]
    cells = np.stack(
        [
            img[lo[0][i] : hi[0][i], lo[1][j] : hi[1][j]].reshape(-1, x.shape[1]).mean(0)
            for i in range(s)
            for j in range(s)
        ]
    )
    w, bias, scale, shift = (np.asarray(a, np.float64) for a in params)
    y = cells @ w.T + bias
    y = (y - y.mean(1, keepdims=True)) / np.sqrt(y.var(1, keepdims=True) + 1e-5)
    return y * scale + shift


def _lara_reference(q, k, v, eps, c, alpha_coeff=1.0, landmarks=None):
    """The official mis-opt LARA estimator, one (batch, head) at a time in float64, with
    explicit densities: ``log xi(x, w) = w . x / sqrt(d) - |x|^2 / (2 sqrt(d))``.
    `landmarks(x, side)`: the landmarks of one head's ``[T, d]`` (default: 1-D segments)."""
    q, k, v, eps = (np.asarray(a, np.float64) for a in (q, k, v, eps))
    b, t, h, d = q.shape
    if landmarks is None:

        def landmarks(x, side):
            return _official_landmarks(x, c)

    out = np.zeros_like(v)
    for bi in range(b):
        for hi in range(h):
            qh, kh, vh = q[bi, :, hi], k[bi, :, hi], v[bi, :, hi]
            q_bar, k_bar = landmarks(qh, "q"), landmarks(kh, "k")
            mu = q_bar + k_bar
            w = mu + eps[bi, hi]  # [C, d]: one sample per proposal

            def xi(x, w=w):  # [N, d] -> [C, N]
                return np.exp(w @ x.T / np.sqrt(d) - (x * x).sum(-1) / (2 * np.sqrt(d)))

            xi_k, xi_q, xi_mu = xi(kh), xi(qh), xi(mu)  # xi_mu[c, c']: mu_c' at sample c
            f = (xi_k / xi_k.sum(1, keepdims=True)) @ vh  # [C, d]
            g = np.diag(xi_mu)  # each sample under its own proposal
            bh = g / xi_mu.sum(1)
            e = np.exp(q_bar @ qh.T / np.sqrt(d))
            t_nc = e / e.sum(1, keepdims=True)  # [C, T], normalised over the queries
            alpha = np.maximum(bh[:, None] + alpha_coeff * (t_nc - t_nc.mean(0)), 1e-8)
            r = alpha * xi_q * xi_k.sum(1)[:, None] / g[:, None]  # [C, T]
            out[bi, :, hi] = (r / r.sum(0)).T @ f
    return out


@pytest.mark.parametrize("t", [24, 22, 3])
def test_lara_peer_is_the_official_estimator_with_the_same_noise(t):
    """T % C == 0, T % C != 0 (the official uneven split) and T <= C (the tokens)."""
    b, h, d, c = 2, 2, 8, 4
    q, k, v = _qkv(b, t, h, d, scale=0.7)
    eps = jax.random.normal(jax.random.key(1), (b, h, min(c, t), d))
    peer = peers.lara_peer(q, k, v, None, num_landmarks=c, eps=eps)
    np.testing.assert_allclose(peer, _lara_reference(q, k, v, eps, c), rtol=1e-4, atol=1e-5)


def test_lara_peer_on_an_image_is_the_official_pool_estimator():
    """The default proposal on an image: adaptive average pooling (here 3 x 5 to 2 x 2, whose
    bins overlap) and the Linear + LayerNorm network of each side, shared by the heads."""
    b, h, d, image, c = 2, 2, 8, (3, 5), 4
    q, k, v = _qkv(b, 15, h, d, scale=0.7)
    params = {s: peers.pool_init(jax.random.key(i + 4), d) for i, s in enumerate("qk")}
    params = {s: (w * 20.0, b + 0.1, g * 1.5, sh - 0.2) for s, (w, b, g, sh) in params.items()}
    eps = jax.random.normal(jax.random.key(1), (b, h, c, d))
    peer = peers.lara_peer(q, k, v, None, num_landmarks=c, eps=eps, image=image, pool_params=params)

    def landmarks(x, side):
        return _pooled_landmarks(x, image, 2, params[side])

    want = _lara_reference(q, k, v, eps, c, landmarks=landmarks)
    np.testing.assert_allclose(peer, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="image"):
        peers.lara_peer(q, k, v, None, num_landmarks=c, eps=eps, image=(4, 4))


def test_lara_peer_is_our_default_lara_with_the_same_noise():
    """The official default (``"pool"``, on a sequence: segment means) is our default
    ``proposal="mean"`` with ``noise_scale=None`` (the peer adds unit noise before the
    ``d^(-1/4)`` scaling, ours ``d^(-1/4)`` after) and the same eps, when C divides T."""
    b, t, h, d, c = 2, 24, 3, 8, 4
    q, k, v = _qkv(b, t, h, d)
    rng = jax.random.key(0)
    ours = lara.lara_attention(q, k, v, {}, rng, num_landmarks=c)
    eps = lara.lara_noise(rng, b, c, 1, h, d)[:, :, 0]  # [B, C, H, d]
    peer = peers.lara_peer(q, k, v, None, num_landmarks=c, eps=jnp.swapaxes(eps, 1, 2))
    np.testing.assert_allclose(peer, ours, rtol=2e-5, atol=2e-5)


def test_lara_peer_on_an_image_is_our_pool_lara():
    """On a 4 x 4 image pooled to 2 x 2: our ``proposal="pool"``, ``grid=(4, 4)``, with the
    peer's shared network copied to every head, and the same noise."""
    b, h, d, c = 2, 3, 8, 4
    q, k, v = _qkv(b, 16, h, d)
    rng = jax.random.key(0)
    params = {s: peers.pool_init(jax.random.key(i + 4), d) for i, s in enumerate("qk")}
    ours_params = {}
    for s, (w, bias, scale, shift) in params.items():
        for name, x in zip(
            (f"proj_{s}_w", f"proj_{s}_b", f"ln_{s}_scale", f"ln_{s}_bias"),
            (w.T, bias, scale, shift),
            strict=True,
        ):
            ours_params[name] = jnp.broadcast_to(x, (h, *x.shape))
    ours = lara.lara_attention(
        q, k, v, ours_params, rng, num_landmarks=c, proposal="pool", grid=(4, 4)
    )
    eps = jnp.swapaxes(lara.lara_noise(rng, b, c, 1, h, d)[:, :, 0], 1, 2)
    peer = peers.lara_peer(
        q, k, v, None, num_landmarks=c, eps=eps, image=(4, 4), pool_params=params
    )
    np.testing.assert_allclose(peer, ours, rtol=2e-5, atol=2e-5)


# ----------------------------------------------------------------------------- RA


def test_ra_peer_is_the_official_estimator_with_the_same_draws():
    """Per query: the key ``argmax_m pi_m / e_m`` (torch.multinomial's one-sample rule), the
    sample ``w = q + k_m* + eps`` and ``softmax_m(log xi(k_m, w)) v``, in float64 loops; the
    draws from a key run too (finite, the shape of v)."""
    b, t, h, d = 2, 9, 2, 8
    q, k, v = _qkv(b, t, h, d)
    k_e, k_n = jax.random.split(jax.random.key(2))
    e = jax.random.exponential(k_e, (b, h, t, t))
    eps = jax.random.normal(k_n, (b, h, t, d))
    peer = peers.ra_peer(q, k, v, None, draws=(e, eps))
    qn, kn, vn, en, epsn = (np.asarray(a, np.float64) for a in (q, k, v, e, eps))
    want = np.zeros_like(vn)
    for bi, hi, n in np.ndindex(b, h, t):
        kh, vh = kn[bi, :, hi], vn[bi, :, hi]
        logits = kh @ qn[bi, n, hi] / np.sqrt(d)
        pi = np.exp(logits - logits.max())
        pi /= pi.sum()
        m_star = int(np.argmax(pi / en[bi, hi, n]))
        w = qn[bi, n, hi] + kh[m_star] + epsn[bi, hi, n]
        s = kh @ w / np.sqrt(d) - (kh * kh).sum(-1) / (2 * np.sqrt(d))
        p = np.exp(s - s.max())
        want[bi, n, hi] = (p / p.sum()) @ vh
    np.testing.assert_allclose(peer, want, rtol=1e-4, atol=1e-5)
    drawn = peers.ra_peer(q, k, v, jax.random.key(0))
    assert drawn.shape == v.shape and bool(jnp.all(jnp.isfinite(drawn)))


# ----------------------------------------------------------------------------- the bench


def test_peer_points_are_skipped_as_the_mechanisms_own():
    """Over the memory budget a peer point is compiled (its memory reported) but not run, and
    the larger T of its series are skipped with the first reason; each peer is timed only in
    the modes it has (ra_peer: non-causal)."""
    from train.bench import scaling

    cfg = scaling.ScalingConfig(
        seq_lens=(16, 32), modes=("noncausal", "causal"), passes=("fwd",), memory_budget_gib=1e-9
    )
    points = peers.peer_points("ra", cfg, series=scaling.Series(cfg, True))
    assert [(p["mechanism"], p["seq_len"], p["mode"]) for p in points] == [
        ("ra_peer", 16, "noncausal"),
        ("ra_peer", 32, "noncausal"),
    ]
    assert all(p["status"] == "skipped" and p["memory"]["total"] > 0 for p in points)
    assert points[1]["note"].startswith("memory at T=16:")
    assert peers.peer_points("softmax", cfg, series=scaling.Series(cfg, True)) == []
