"""Stand-ins of public algorithms that train in our models, registered as mechanisms
(`training_peer`): what ``python -m train.bench equivalence`` trains beside ours.

* ``performer_peer``: `peers.performer_peer` (the public Performer-JAX FAVOR+) with its
  query-seeded redraw at every call.
* ``rfa_peer``: haopeng-uw ``RFA`` (``random_project`` with ``rrf`` features, a stored bank
  of random matrices sampled once per training step), PyTorch.
* ``hedgehog_peer``: the Hedgehog paper's map (Zhang et al. 2024, its listing of
  ``HedgehogFeatureMap`` / ``HedgehogAttention``): one trainable ``Linear(d, d)`` for the
  queries and another for the keys, each initialised to the identity with zero bias and
  shared by the heads, ``phi(x) = [exp(W x + b), exp(-(W x + b))]``, the attention
  ``phi(q) phi(k)^T v / phi(q) phi(k)^T 1``, PyTorch.
* ``linear_elu_peer``: fast-transformers' ``LinearAttention`` (idiap, Katharopoulos et al.
  2020): ``phi(x) = elu(x) + 1`` for both, ``phi(q) (phi(k)^T v) / (phi(q) . sum phi(k) +
  1e-6)``, PyTorch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import linattn_jax as la
from train.bench import peers

#: The public RFA's feature scale and denominator clamp (``SCALE``, ``EPS`` of the
#: haopeng-uw/RFA ``utils.py`` at 6d59b1c).
RFA_SCALE = 0.1
RFA_EPS = 0.1
#: How many stored random matrices the public RFA samples from (its suggested 200).
RFA_BANK = 200


def _linear_sums(pq, pk, v):
    """Non-causal linear attention's numerator ``phi(q_i) . sum_j phi(k_j) v_j^T`` ``[B, T,
    H, D]`` and denominator ``phi(q_i) . sum_j phi(k_j)`` ``[B, T, H]`` from the features
    ``[B, T, H, M]`` (each peer applies its own denominator rule)."""
    s = jnp.einsum("bthm,bthd->bhmd", pk, v.astype(jnp.float32))
    den = jnp.einsum("bthm,bhm->bth", pq, jnp.sum(pk, axis=1))
    return jnp.einsum("bthm,bhmd->bthd", pq, s), den


def rfa_peer_init(rng, *, num_heads: int, head_dim: int, num_features: int = 64):
    """The public RFA's state: ``bank [RFA_BANK, M, d]`` Gaussian matrices (its ``rrf``
    files, loaded as a non-trainable parameter) and ``sigma [H, 1, d]`` (its
    ``reparam_proj``, init 1; learnable, as our rfa's ``sigma``)."""
    return {
        "bank": jax.random.normal(rng, (RFA_BANK, num_features, head_dim), jnp.float32),
        "sigma": jnp.ones((num_heads, 1, head_dim), jnp.float32),
    }


def rfa_peer(
    q, k, v, params, rng=None, *, mask=None, causal=False, deterministic=False, num_features=64
):
    """The public RFA (haopeng-uw/RFA ``random_project`` with ``rrf`` features, tau 1,
    ``reparam_proj``), non-causal: ``[B, T, H, D]`` in and out.

    Structure followed: in training (``deterministic=False``) every call samples H of the
    stored matrices without replacement (their ``sample_random_matrices``; here from `rng`),
    in evaluation the first H; ``W = sigma * W~``; ``x^ = x / (|x| + 1e-3)``; ``phi(x) =
    SCALE [sin(W x^), cos(W x^)]`` interleaved; the attention ``phi(q) (phi(k)^T v)`` over
    ``phi(q) . sum phi(k)`` clamped below at ``EPS``. Differences: no causal or cross-attention
    forms (the benchmark's tasks are bidirectional), `mask` zeroes the keys it drops.
    """
    if causal:
        raise ValueError("rfa_peer: the stand-in has no causal form")
    h = q.shape[2]
    bank = lax.stop_gradient(params["bank"])
    if deterministic:
        w = bank[:h]
    else:
        w = bank[jax.random.choice(rng, bank.shape[0], (h,), replace=False)]
    w = params["sigma"] * w  # [H, M, d]

    def phi(x):
        x = x / (jnp.linalg.norm(x, axis=-1, keepdims=True) + 1e-3)
        p = jnp.einsum("bthd,hmd->bthm", x, w)
        return RFA_SCALE * jnp.stack([jnp.sin(p), jnp.cos(p)], -1).reshape(*p.shape[:-1], -1)

    qp, kp = phi(q), phi(k)
    if mask is not None:
        kp = kp * mask[:, :, None, None]
    num, den = _linear_sums(qp, kp, v)
    return num / jnp.maximum(den, RFA_EPS)[..., None]


def hedgehog_peer_init(rng, *, num_heads: int, head_dim: int):
    """The Hedgehog listing's two feature maps: ``{"wq", "wk": [d, d] identity, "bq", "bk":
    [d] zeros}`` (one ``Linear`` each for queries and keys, shared by the heads)."""
    del rng, num_heads
    eye, zero = jnp.eye(head_dim, dtype=jnp.float32), jnp.zeros((head_dim,), jnp.float32)
    return {"wq": eye, "bq": zero, "wk": eye, "bk": zero}


def hedgehog_peer(q, k, v, params, rng=None, *, mask=None, causal=False, deterministic=False):
    """The Hedgehog paper's attention, non-causal, ``[B, T, H, D]`` in and out.

    ``phi_q(x) = [exp(Wq x + bq), exp(-(Wq x + bq))]`` and ``phi_k`` with its own ``Wk, bk``
    (as the listing's ``mlp_q``, ``mlp_k``); the weights ``phi_q(q_i) . phi_k(k_j)`` over
    their row sum. The exponent's detached maximum (per query token; per batch row and head
    over every key) is subtracted before the exp: it cancels in the ratio and keeps the
    float32 exp finite, so this is the listing's value, not a change of it. `mask` zeroes
    the keys it drops. No causal form (the benchmark's tasks are bidirectional).
    """
    del rng, deterministic
    if causal:
        raise ValueError("hedgehog_peer: the stand-in has no causal form")

    def logits(x, w, b):
        a = jnp.einsum("bthd,ed->bthe", x.astype(jnp.float32), w) + b[None, None, None]
        return jnp.concatenate([a, -a], axis=-1)

    aq = logits(q, params["wq"], params["bq"])
    ak = logits(k, params["wk"], params["bk"])
    if mask is not None:
        ak = jnp.where(mask[:, :, None, None], ak, -jnp.inf)
    pq = jnp.exp(aq - lax.stop_gradient(jnp.max(aq, axis=-1, keepdims=True)))
    pk = jnp.exp(ak - lax.stop_gradient(jnp.max(ak, axis=(1, 3), keepdims=True)))
    num, den = _linear_sums(pq, pk, v)
    return num / den[..., None]


def linear_elu_peer(q, k, v, params=None, rng=None, *, mask=None, causal=False,
                    deterministic=False):  # fmt: skip
    """fast-transformers' ``LinearAttention`` (``elu_feature_map``, ``eps=1e-6``),
    non-causal, ``[B, T, H, D]`` in and out; `mask` zeroes the keys it drops (its
    ``key_lengths`` mask)."""
    del params, rng, deterministic
    if causal:
        raise ValueError("linear_elu_peer: the stand-in has no causal form")
    pq = jax.nn.elu(q.astype(jnp.float32)) + 1.0
    pk = jax.nn.elu(k.astype(jnp.float32)) + 1.0
    if mask is not None:
        pk = pk * mask[:, :, None, None]
    num, den = _linear_sums(pq, pk, v)
    return num / (den + 1e-6)[..., None]


def performer_peer_attention(
    q, k, v, params=None, rng=None, *, mask=None, causal=False, deterministic=False,
    num_features=256,
):  # fmt: skip
    """`performer_peer` as a registry attention function (no params; for training): the
    public code's own query-seeded redraw at every call, training or not. The public
    function has no key-padding mask: `mask` must be all True (an image task's)."""
    del params, rng, mask, deterministic
    return peers.performer_peer(q, k, v, None, num_features=num_features, causal=causal)


#: name -> the registry record of a peer that trains in our models (`training_peer`).
TRAINING_PEERS = {
    "performer": dict(
        init_fn=lambda rng, *, num_heads, head_dim, num_features=256: {},
        attention_fn=performer_peer_attention,
        supports_causal=True,
        stochastic=False,
        description="public Performer-JAX FAVOR+ (stand-in), query-seeded redraw",
    ),
    "rfa": dict(
        init_fn=rfa_peer_init,
        attention_fn=rfa_peer,
        supports_causal=False,
        stochastic=True,
        fixed_fn=lambda **_: frozenset({"bank"}),
        description="public RFA (stand-in): a stored matrix bank, one sample per step",
    ),
    "hedgehog": dict(
        init_fn=hedgehog_peer_init,
        attention_fn=hedgehog_peer,
        supports_causal=False,
        stochastic=False,
        description="the Hedgehog paper's map (stand-in): exp, separate query and key maps",
    ),
    "linear_elu": dict(
        init_fn=lambda rng, *, num_heads, head_dim: {},
        attention_fn=linear_elu_peer,
        supports_causal=False,
        stochastic=False,
        description="fast-transformers' LinearAttention (stand-in): elu + 1, eps 1e-6",
    ),
}


def training_peer(name: str) -> str:
    """Registers (once) the peer of `name` as the mechanism ``<name>_peer``, so that
    ``python -m train`` and `train.loop` train it in our models; returns its name."""
    if name not in TRAINING_PEERS:
        raise ValueError(f"no training peer for {name!r}; have {sorted(TRAINING_PEERS)}")
    peer = peers.peer_name(name)
    if peer not in la.names():
        la.register(la.Mechanism(name=peer, **TRAINING_PEERS[name]))
    return peer
