"""`train.bench.training_peers`: the public algorithms that train in our models, checked
against naive forms of them, and the equivalence benchmark's arms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.bench import equivalence, training_peers


def _qkv(b, t, h, d):
    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32) for _ in range(3))


def test_rfa_peer_is_the_public_rfa_as_a_quadratic_form():
    """Evaluation uses the bank's first H matrices; the output is ``A v / max(A 1, EPS)``
    with ``A = phi(q) phi(k)^T``, ``phi(x) = SCALE [sin; cos](sigma W~ x / (|x| + 1e-3))``
    (float64 loops here); a training call samples H distinct bank matrices from its rng."""
    q, k, v = _qkv(1, 6, 2, 4)
    params = training_peers.rfa_peer_init(
        jax.random.key(0), num_heads=2, head_dim=4, num_features=3
    )
    params["sigma"] = params["sigma"] * 0.7
    mask = jnp.arange(6)[None, :] < 5
    got = training_peers.rfa_peer(q, k, v, params, mask=mask, deterministic=True)
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    want = np.zeros_like(vn)
    for h in range(2):
        w = 0.7 * np.asarray(params["bank"][h], np.float64)

        def phi(x, w=w):
            p = w @ (x / (np.linalg.norm(x) + 1e-3))
            return training_peers.RFA_SCALE * np.stack([np.sin(p), np.cos(p)], -1).reshape(-1)

        for i in range(6):
            a = np.array([phi(qn[0, i, h]) @ phi(kn[0, j, h]) for j in range(5)])
            want[0, i, h] = a @ vn[0, :5, h] / max(a.sum(), training_peers.RFA_EPS)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    a = training_peers.rfa_peer(q, k, v, params, jax.random.key(1))
    b = training_peers.rfa_peer(q, k, v, params, jax.random.key(2))
    assert not np.allclose(a, b) and np.isfinite(np.asarray(a)).all()


def test_hedgehog_and_linear_elu_peers_are_their_public_maps_as_quadratic_forms():
    """hedgehog_peer: ``A_ij = phi_q(q_i) . phi_k(k_j)`` with ``phi(x) = [exp(W x + b);
    exp(-(W x + b))]``, separate query and key maps shared by the heads; linear_elu_peer:
    ``A_ij = (elu(q_i) + 1) . (elu(k_j) + 1)``, ``A v / (A 1 + 1e-6)``; masked keys dropped
    (float64 loops here)."""
    q, k, v = _qkv(1, 5, 2, 3)
    params = training_peers.hedgehog_peer_init(None, num_heads=2, head_dim=3)
    rng = np.random.default_rng(1)
    params = {n: p + 0.3 * jnp.asarray(rng.standard_normal(p.shape), jnp.float32)
              for n, p in params.items()}  # fmt: skip
    mask = jnp.arange(5)[None, :] < 4
    qn, kn, vn = (np.asarray(x, np.float64)[0] for x in (q, k, v))
    pn = {n: np.asarray(p, np.float64) for n, p in params.items()}

    def hh(x, side):
        a = pn["w" + side] @ x + pn["b" + side]
        return np.exp(np.concatenate([a, -a]))

    def elu1(x):
        return np.where(x > 0, x + 1, np.exp(x))

    for name, got, phi_q, phi_k, eps in (
        ("hedgehog", training_peers.hedgehog_peer(q, k, v, params, mask=mask),
         lambda x: hh(x, "q"), lambda x: hh(x, "k"), 0.0),
        ("linear_elu", training_peers.linear_elu_peer(q, k, v, mask=mask), elu1, elu1, 1e-6),
    ):  # fmt: skip
        want = np.zeros_like(vn)
        for h in range(2):
            for i in range(5):
                a = np.array([phi_q(qn[i, h]) @ phi_k(kn[j, h]) for j in range(4)])
                want[i, h] = a @ vn[:4, h] / (a.sum() + eps)
        np.testing.assert_allclose(np.asarray(got)[0], want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_training_peers_register_once_and_train_in_the_equivalence_configs():
    """``<name>_peer`` is registered on first use (idempotent); the equivalence bench's
    arms differ from ours only in the mechanism (the peer, same ``num_features``) or in
    ``redraw="call"``."""
    assert training_peers.training_peer("rfa") == training_peers.training_peer("rfa") == "rfa_peer"
    ours, call, public = (
        equivalence.arm_config("pathfinder", "performer", arm, 3) for arm in equivalence.ARMS
    )
    assert (ours.attention, call.attention, public.attention) == (
        "performer", "performer", "performer_peer"
    )  # fmt: skip
    assert ours.attention_config.to_dict() == public.attention_config.to_dict()
    assert call.attention_config.to_dict() == {**ours.attention_config.to_dict(), "redraw": "call"}
    assert ours.seed == 3 and ours.num_train_steps == 5000
    with pytest.raises(ValueError, match="no training peer"):
        training_peers.training_peer("softmax")
    assert equivalence.default_arms("hedgehog") == ("ours", "public")
    assert equivalence.default_arms("rfa") == equivalence.ARMS
    with pytest.raises(ValueError, match="hedgehog draws no features"):
        equivalence.arm_config("pathfinder", "hedgehog", "ours_redraw_call", 0)
