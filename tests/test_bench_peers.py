"""`train.bench.peers`: the official-layout LARA peer computes our default LARA."""

import jax
import jax.numpy as jnp
import numpy as np

from linattn_jax import randomized
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
    ours = randomized.lara_attention(q, k, v, {}, rng, num_landmarks=c)
    eps = randomized.lara_noise(rng, b, c, 1, h, d)[:, :, 0]  # [B, C, H, d]
    peer = peers.lara_peer(q, k, v, None, num_landmarks=c, eps=jnp.swapaxes(eps, 1, 2))
    np.testing.assert_allclose(peer, ours, rtol=2e-5, atol=2e-5)
    # T % C != 0: the official split runs and gives a finite output of the same shape.
    odd = peers.lara_peer(q[:, :22], k[:, :22], v[:, :22], rng, num_landmarks=c)
    assert odd.shape == (b, 22, h, d) and bool(jnp.all(jnp.isfinite(odd)))
