"""Helpers shared by the nnx and linen modules."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from linattn_jax import registry

#: Logical axis names of the projection kernels (map them to mesh axes with rules).
QKV_AXES = ("embed", "heads", "kv")
OUT_AXES = ("heads", "kv", "embed")


def bound_mechanism(name: str, config: Mapping[str, Any] | None) -> registry.Mechanism:
    """The registry mechanism `name` with `config` bound (validated: unknown keys raise)."""
    return registry.get(name).bind(**dict(config or {}))


def split_params(mech: registry.Mechanism, params: Mapping[str, Any]):
    """``(trainable, fixed)`` dicts of a mechanism's params."""
    fixed = mech.fixed_params()
    trainable = {k: v for k, v in params.items() if k not in fixed}
    return trainable, {k: v for k, v in params.items() if k in fixed}


def head_dims(num_heads: int, features: int) -> int:
    if features % num_heads:
        raise ValueError(f"qkv_features={features} must be divisible by num_heads={num_heads}")
    return features // num_heads


def attention_fn(name: str, *, causal: bool = False, **config):
    """An ``attention_fn`` for ``flax.linen.MultiHeadDotProductAttention`` or
    ``flax.nnx.MultiHeadAttention``, from a mechanism with no params.

    The returned function has Flax's signature ``(query, key, value, bias=None,
    mask=None, ..., deterministic=..., dropout_rng=..., ...)`` with
    ``[batch, length, heads, depth]`` arrays. Flax's `mask`
    ``[batch, heads|1, q_len, kv_len]`` is reduced to the key-padding mask our
    mechanisms take (key j is attended if any query attends to it), which is
    exact for padding masks such as ``nn.make_attention_mask(q_pad, k_pad)``;
    express causality with ``causal=True`` here, not in `mask`. `bias` and
    dropout are not supported. A stochastic mechanism (ra, lara) samples with
    `dropout_rng` when not deterministic.

    Raises:
      ValueError: the mechanism has params for this config (use the module instead).
    """
    mech = bound_mechanism(name, config)
    shapes = jax.eval_shape(lambda r: mech.init(r, num_heads=1, head_dim=8), jax.random.key(0))
    if jax.tree_util.tree_leaves(shapes):
        raise ValueError(
            f"mechanism {name!r} has params {sorted(shapes)}; attention_fn only adapts "
            "param-free mechanisms: use linattn_jax.nn/linen.MultiHeadAttention instead"
        )

    def fn(
        query, key, value, bias=None, mask=None, *, deterministic=False, dropout_rng=None, **unused
    ):
        del unused
        if bias is not None:
            raise ValueError(f"attention_fn({name!r}) does not support an additive bias")
        key_mask = None
        if mask is not None:
            key_mask = jax.numpy.any(mask.astype(bool), axis=(-3, -2))
            key_mask = jax.numpy.broadcast_to(key_mask, key.shape[:2])
        return mech.attention(
            query,
            key,
            value,
            {},
            dropout_rng,
            mask=key_mask,
            causal=causal,
            deterministic=deterministic or not mech.stochastic,
        )

    return fn
