"""LRA models (`train.models.layers.Block` stacks): encoder classifier and dual encoder.

The encoder (LRA's ``TransformerEncoder``, pre-LN)::

    x = embed(tokens)                              [B, T, E]
        or the image stem: Dense(pixel / 255) -> conv_stem x (3x3 conv -> gelu)
        -> patch_size x patch_size patches         [B, T' = T / patch_size^2, E]
    x = x [+ CLS] + pos_emb                        [B, T'(+1), E]
    repeat num_layers:  x = x + Dropout(MHA(LN(x), mask))
                        x = x + MLP(LN(x))         MLP: Dense(mlp) -> gelu -> Dense(E)
    x = LN(x)

with the attention any registered mechanism (``linattn_jax.linen.MultiHeadAttention``,
``attention=<registry name>``). Token id 0 is padding: ``tokens != 0`` is the key-padding
mask of every attention layer (``pad_mask=False`` for images, where 0 is a black pixel).
Pooling: ``cls`` (a learned CLS vector prepended, always attended; LRA's choice), ``mean``
(mean over non-pad positions), ``first`` (position 0, no extra token). The classifier head
is LRA's ``Dense(mlp) -> relu -> Dense(num_classes)``; the dual encoder (Retrieval) runs one
shared encoder on both documents and classifies ``[u, v, u * v, u - v]``.

The image stem (``conv_stem > 0`` or ``patch_size > 1``; off by default, as in LRA, which
embeds each grey level as a token) reads the T token ids as the intensities of a square
S x S image (``id / (vocab_size - 1)``), embeds them linearly, applies ``conv_stem`` 3x3
convolutions (width E, gelu) and cuts the grid into ``patch_size`` x ``patch_size``
patches (one strided convolution), so the attention sees ``T / patch_size^2`` tokens that
each know their neighbourhood. The mini Pathfinder preset uses it: on a 2-core CPU budget
a transformer over grey-level tokens does not learn that task (it memorises the training
images through their exact grey levels; README, Pathfinder).

Parameters carry logical axis names (``vocab``, ``embed``, ``mlp``, ``heads``, ``kv``,
``classes``) for FSDP-style sharding by the rules in the config. Collections: ``params``;
``fixed`` (fixed random features of performer-like mechanisms, not trained). RNG streams:
``dropout`` and ``attention`` (sampling mechanisms).

Mixed precision: ``dtype`` (e.g. ``jnp.bfloat16``, config ``model.dtype``) is the computation
dtype of embeddings, projections, MLPs and layer norms (whose statistics flax computes in
float32); parameters stay float32 (``param_dtype``), the attention mechanisms keep their
float32 internals, and the logits are returned in float32.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from .layers import (
    Block,
    attention_config_pairs,
    compute_dtype,
    dense,
    embedding,
    layer_norm,
    learned_positions,
    prepend_cls,
    sinusoidal_positions,
)

POOLINGS = ("cls", "mean", "first")
POS_EMBS = ("learned", "sinusoidal")


class Encoder(nn.Module):
    """Token ids ``[B, T]`` -> pooled ``[B, E]`` (see the module docstring).

    Attributes:
      vocab_size: number of token ids (0 = pad).
      max_len: T, the input length (positions are sized from it).
      num_layers, emb_dim, num_heads, qkv_dim, mlp_dim: sizes.
      attention, attention_config: the mechanism (registry name, config pairs).
      dropout_rate: dropout on embeddings, attention and MLP outputs.
      pooling: one of ``POOLINGS``.
      pos_emb: one of ``POS_EMBS``.
      pad_mask: whether token 0 is padding (masked out of attention and mean pooling).
      tied_layers: share one block across all layers.
      conv_stem: 3x3 convolution layers of the image stem (0: none).
      patch_size: side of the square patches the image stem cuts (1: one token per pixel).
      dtype: computation dtype (None: float32 from the params; ``jnp.bfloat16`` for mixed
        precision). Parameters are float32 either way.
      mesh, batch_axes: the attention runs sequence-parallel over the mesh axis ``"seq"``
        (`train.models.layers.Block`); T (+1 with the CLS token) must divide by its size.
    """

    vocab_size: int
    max_len: int
    num_layers: int = 2
    emb_dim: int = 64
    num_heads: int = 4
    qkv_dim: int = 64
    mlp_dim: int = 128
    attention: str = "softmax"
    attention_config: Any = ()
    dropout_rate: float = 0.0
    pooling: str = "cls"
    pos_emb: str = "learned"
    pad_mask: bool = True
    tied_layers: bool = False
    conv_stem: int = 0
    patch_size: int = 1
    dtype: Any = None
    mesh: Any = None
    batch_axes: Any = None

    def image_stem(self, tokens, mask):
        """Pixel ids ``[B, S*S]`` -> ``[B, (S/p)^2, E]`` and the mask (module docstring)."""
        (b, t), e = tokens.shape, self.emb_dim
        side = math.isqrt(t)
        if side * side != t or side % self.patch_size:
            raise ValueError(
                f"the image stem (conv_stem={self.conv_stem}, patch_size={self.patch_size}) "
                f"needs a square grid of tokens whose side divides by patch_size, got T={t}"
            )
        if self.pad_mask:
            raise ValueError("the image stem needs pad_mask=False (every pixel is a token)")
        if self.conv_stem < 0 or self.patch_size < 1:
            raise ValueError(
                f"need conv_stem >= 0 and patch_size >= 1, got {self.conv_stem}, {self.patch_size}"
            )
        x = tokens.reshape(b, side, side, 1).astype(jnp.float32) / (self.vocab_size - 1)
        x = dense(e, "pixel_embed", (None, "embed"), self.dtype)(x)  # [B, S, S, E]
        for i in range(self.conv_stem):
            x = nn.gelu(nn.Conv(e, (3, 3), dtype=self.dtype, name=f"stem_{i}")(x))
        p = self.patch_size
        if p > 1:
            x = nn.Conv(e, (p, p), strides=(p, p), dtype=self.dtype, name="patches")(x)
        side //= p
        return x.reshape(b, side * side, e), mask[:, : side * side]

    @property
    def num_tokens(self) -> int:
        """Tokens the attention sees at ``T = max_len`` (after the image stem's patches)."""
        return self.max_len // (self.patch_size * self.patch_size)

    @nn.compact
    def __call__(self, tokens, *, deterministic: bool):
        """``tokens`` int ``[B, T]`` -> pooled features ``[B, E]``."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T] int ids, got shape {tokens.shape}")
        if tokens.shape[1] > self.max_len:
            raise ValueError(f"tokens length {tokens.shape[1]} exceeds max_len={self.max_len}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.pos_emb not in POS_EMBS:
            raise ValueError(f"pos_emb must be one of {POS_EMBS}, got {self.pos_emb!r}")
        b, t = tokens.shape
        mask = tokens != 0 if self.pad_mask else jnp.ones((b, t), bool)  # [B, T]
        if self.conv_stem or self.patch_size != 1:
            x, mask = self.image_stem(tokens, mask)  # [B, T', E]
        else:
            x = embedding(self.vocab_size, self.emb_dim, 1.0, self.dtype)(tokens)  # [B, T, E]
        if self.pooling == "cls":
            x = prepend_cls(self, x)
            mask = jnp.concatenate([jnp.ones((b, 1), bool), mask], axis=1)  # CLS attends
        length = x.shape[1]
        if self.pos_emb == "learned":
            pos = learned_positions(self, self.num_tokens + (self.pooling == "cls"), self.emb_dim)
        else:
            pos = jnp.asarray(sinusoidal_positions(self.num_tokens + 1, self.emb_dim))
        x = x + pos[None, :length].astype(x.dtype)
        x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)

        def block(name):
            return Block(
                num_heads=self.num_heads,
                qkv_dim=self.qkv_dim,
                mlp_dim=self.mlp_dim,
                attention=self.attention,
                attention_config=self.attention_config,
                dropout_rate=self.dropout_rate,
                dtype=self.dtype,
                mesh=self.mesh,
                batch_axes=self.batch_axes,
                name=name,
            )

        shared = block("block") if self.tied_layers else None
        for i in range(self.num_layers):
            x = (shared or block(f"block_{i}"))(x, mask, deterministic=deterministic)
        x = layer_norm("ln_final", self.dtype)(x)  # [B, T', E]
        if self.pooling == "mean":
            w = mask.astype(jnp.float32)[..., None]  # [B, T, 1]; the sum in float32
            return jnp.sum(x.astype(jnp.float32) * w, axis=1) / jnp.maximum(jnp.sum(w, 1), 1.0)
        return x[:, 0]  # cls / first


class ClassifierHead(nn.Module):
    """``Dense(mlp_dim) -> relu -> Dense(num_classes)``: ``[B, F] -> [B, C]`` float32 logits
    (LRA's head)."""

    num_classes: int
    mlp_dim: int
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        x = nn.relu(dense(self.mlp_dim, "hidden", ("embed", "mlp"), self.dtype)(x))
        return dense(self.num_classes, "logits", ("mlp", "classes"), self.dtype)(x).astype(
            jnp.float32
        )


class EncoderClassifier(nn.Module):
    """Encoder + head: tokens ``[B, T]`` -> logits ``[B, num_classes]``."""

    encoder: Encoder
    num_classes: int

    @nn.compact
    def __call__(self, tokens, *, deterministic: bool = True):
        pooled = self.encoder(tokens, deterministic=deterministic)
        return ClassifierHead(
            self.num_classes, self.encoder.mlp_dim, self.encoder.dtype, name="head"
        )(pooled)


class DualEncoderClassifier(nn.Module):
    """Shared encoder on both documents; head on ``[u, v, u*v, u-v]``: -> ``[B, num_classes]``."""

    encoder: Encoder
    num_classes: int

    @nn.compact
    def __call__(self, tokens1, tokens2, *, deterministic: bool = True):
        if tokens1.shape != tokens2.shape:
            raise ValueError(f"pair inputs must share a shape: {tokens1.shape} vs {tokens2.shape}")
        # One call on the stacked pair: the same encoder (shared params), one trace.
        both = self.encoder(
            jnp.concatenate([tokens1, tokens2], axis=0), deterministic=deterministic
        )
        u, v = jnp.split(both, 2, axis=0)  # [B, E] each
        feats = jnp.concatenate([u, v, u * v, u - v], axis=-1)  # [B, 4E]
        return ClassifierHead(
            self.num_classes, self.encoder.mlp_dim, self.encoder.dtype, name="head"
        )(feats)


def build_encoder(config, *, vocab_size: int, max_len: int) -> Encoder:
    """The ``Encoder`` described by ``config.model`` / ``config.attention``."""
    m = config.model
    return Encoder(
        vocab_size=vocab_size,
        max_len=max_len,
        num_layers=m.num_layers,
        emb_dim=m.emb_dim,
        num_heads=m.num_heads,
        qkv_dim=m.qkv_dim,
        mlp_dim=m.mlp_dim,
        attention=config.attention,
        attention_config=attention_config_pairs(config.attention_config),
        dropout_rate=m.dropout_rate,
        pooling=m.pooling,
        pos_emb=m.pos_emb,
        pad_mask=m.pad_mask,
        tied_layers=m.tied_layers,
        conv_stem=m.get("conv_stem", 0),
        patch_size=m.get("patch_size", 1),
        dtype=compute_dtype(config),
    )


def build_classifier(config, *, vocab_size: int, num_classes: int, seq_len: int, is_pair: bool):
    """``EncoderClassifier`` (or ``DualEncoderClassifier`` when ``is_pair``) from a config."""
    encoder = build_encoder(config, vocab_size=vocab_size, max_len=seq_len)
    cls = DualEncoderClassifier if is_pair else EncoderClassifier
    return cls(encoder=encoder, num_classes=num_classes)


__all__ = [
    "ClassifierHead",
    "DualEncoderClassifier",
    "Encoder",
    "EncoderClassifier",
    "POOLINGS",
    "POS_EMBS",
    "build_classifier",
    "build_encoder",
]
