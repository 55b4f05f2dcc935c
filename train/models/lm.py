"""Decoder-only causal language model (`CausalLM`, pre-LN GPT-style).

::

    x = embed(tokens) + pos_emb                                [B, T, E]
    repeat num_layers:  x = x + MHA(LN(x), causal=True)
                        x = x + MLP(LN(x))
    logits = LN(x) @ embed^T  (tied) or Dense(vocab)           [B, T, V]

with the attention any causal mechanism (``la.causal_names()``) and the blocks
`train.models.layers.Block`. With ``decode=True`` the model takes one token per call and keeps
the attention state in the ``cache`` collection (recurrent decoding; see `train.generate`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import linattn_jax as la

from .layers import (
    Block,
    attention_config_pairs,
    compute_dtype,
    dense,
    embedding,
    layer_norm,
    learned_positions,
)

#: byte-level vocabulary: 256 bytes + 1, 0 = pad (`train.data.tokenizers`)
VOCAB_SIZE = 259
_f32 = jnp.float32


class CausalLM(nn.Module):
    """Decoder-only LM: tokens ``[B, T]`` -> logits ``[B, T, vocab_size]`` float32.

    With ``decode=True`` tokens are ``[B, 1]``: one step of recurrent decoding (the caller
    makes the ``cache`` collection mutable; see `init_cache`, `decode_step`). ``dtype``: the
    computation dtype (``jnp.bfloat16`` for mixed precision; params stay float32).
    ``mesh`` / ``batch_axes``: the attention runs sequence-parallel over the mesh axis
    ``"seq"`` (`train.models.layers.Block`; not in decode mode).
    """

    vocab_size: int = VOCAB_SIZE
    max_len: int = 256
    num_layers: int = 2
    emb_dim: int = 64
    num_heads: int = 4
    qkv_dim: int = 64
    mlp_dim: int = 256
    attention: str = "softmax"
    attention_config: Any = ()
    dropout_rate: float = 0.0
    tie_embeddings: bool = True
    dtype: Any = None
    mesh: Any = None
    batch_axes: Any = None

    @nn.compact
    def __call__(self, tokens, *, deterministic: bool = True, decode: bool = False):
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T] int ids, got shape {tokens.shape}")
        mech = la.get(self.attention)
        if not mech.supports_causal:
            raise ValueError(
                f"CausalLM needs a causal mechanism; {self.attention!r} is not one of "
                f"{la.causal_names()}"
            )
        b, t = tokens.shape
        if decode and t != 1:
            raise ValueError(f"decode=True takes one token per call, got tokens {tokens.shape}")
        if t > self.max_len:
            raise ValueError(f"tokens length {t} exceeds max_len={self.max_len}")
        embed = embedding(self.vocab_size, self.emb_dim, 0.02, self.dtype)
        pos = learned_positions(self, self.max_len, self.emb_dim)
        if decode:
            initialized = self.has_variable("cache", "position")
            index = self.variable("cache", "position", lambda: jnp.zeros((), jnp.int32))
            p = jax.lax.dynamic_slice_in_dim(pos, index.value, 1, axis=0)  # [1, E]
            if initialized:
                index.value = index.value + 1
        else:
            p = pos[:t]
        x = embed(tokens)
        x = x + p[None].astype(x.dtype)
        x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
        for i in range(self.num_layers):
            x = Block(
                num_heads=self.num_heads,
                qkv_dim=self.qkv_dim,
                mlp_dim=self.mlp_dim,
                attention=self.attention,
                attention_config=self.attention_config,
                dropout_rate=self.dropout_rate,
                causal=True,
                decode=decode,
                max_len=self.max_len,
                dtype=self.dtype,
                mesh=self.mesh,
                batch_axes=self.batch_axes,
                name=f"block_{i}",
            )(x, deterministic=deterministic)
        x = layer_norm("ln_final", self.dtype)(x)
        if self.tie_embeddings:
            return embed.attend(x).astype(_f32)
        return dense(self.vocab_size, "logits", ("embed", "vocab"), self.dtype)(x).astype(_f32)


def build_lm(config, vocab_size: int = VOCAB_SIZE) -> CausalLM:
    """The `CausalLM` of ``config.model`` / ``config.attention`` / ``config.attention_config``."""
    m = config.model
    return CausalLM(
        vocab_size=vocab_size,
        max_len=int(config.data.seq_len),
        num_layers=int(m.num_layers),
        emb_dim=int(m.emb_dim),
        num_heads=int(m.num_heads),
        qkv_dim=int(m.qkv_dim),
        mlp_dim=int(m.mlp_dim),
        attention=config.attention,
        attention_config=attention_config_pairs(config.attention_config),
        dropout_rate=float(m.dropout_rate),
        tie_embeddings=bool(m.tie_embeddings),
        dtype=compute_dtype(config),
    )


__all__ = ["VOCAB_SIZE", "CausalLM", "build_lm"]
