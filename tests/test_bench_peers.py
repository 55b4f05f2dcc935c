"""`train.bench.peers`: the official-layout LARA peer computes our default LARA."""

import jax
import jax.numpy as jnp
import numpy as np

from linattn_jax import lara
from train.bench import peers


def test_lara_peer_is_our_default_lara_with_the_same_noise():
    """The peer adds unit noise to the unscaled mu before its d^(-1/4) scaling: our
    ``noise_scale=None`` (d^(-1/4) in the scaled space) with the same eps. T % C == 0 and
    T % C != 0 (the official split and ours differ, so only the divisible case is equal)."""
    b, t, h, d, c = 2, 24, 3, 8, 4
    q, k, v = (
        jnp.asarray(np.random.default_rng(i).standard_normal((b, t, h, d)), jnp.float32)
        for i in range(3)
    )
    rng = jax.random.key(0)
    ours = lara.lara_attention(q, k, v, {}, rng, num_landmarks=c)
    eps = lara.lara_noise(rng, b, c, 1, h, d)[:, :, 0]  # [B, C, H, d]
    peer = peers.lara_peer(q, k, v, None, num_landmarks=c, eps=jnp.swapaxes(eps, 1, 2))
    np.testing.assert_allclose(peer, ours, rtol=2e-5, atol=2e-5)
    # T % C != 0: the official split runs and gives a finite output of the same shape.
    odd = peers.lara_peer(q[:, :22], k[:, :22], v[:, :22], rng, num_landmarks=c)
    assert odd.shape == (b, 22, h, d) and bool(jnp.all(jnp.isfinite(odd)))


def test_performer_peer_is_our_performer_with_the_same_features(monkeypatch):
    """The public FAVOR+ layout (length first, one shared [M, d] projection, key stabiliser
    over all keys) computes our performer with that projection as its shared features,
    non-causal and causal. Both add a 1e-6 to every feature after different stabilisers
    (theirs: the max over all keys, so a small key's features get relatively more): that
    term is turned off on both sides for the comparison."""
    import linattn_jax as la
    from linattn_jax import performer

    monkeypatch.setattr(performer, "FEATURE_EPS", 0.0)
    b, t, h, d, m = 2, 10, 3, 8, 16
    q, k, v = (
        jnp.asarray(np.random.default_rng(i).standard_normal((b, t, h, d)), jnp.float32)
        for i in range(3)
    )
    rng = jax.random.key(0)
    w = peers._orthogonal_projection(rng, m, d)
    rows = np.asarray(w[:d] / jnp.linalg.norm(w[:d], axis=1, keepdims=True))
    np.testing.assert_allclose(rows @ rows.T, np.eye(d), atol=1e-5)  # an orthogonal block
    mech = la.get("performer")
    for causal in (False, True):
        peer = peers.performer_peer(q, k, v, rng, num_features=m, causal=causal, stabilizer=0.0)
        ours = mech.attention(q, k, v, {"features": w[None]}, causal=causal, deterministic=True)
        np.testing.assert_allclose(peer, ours, rtol=1e-4, atol=1e-5)
