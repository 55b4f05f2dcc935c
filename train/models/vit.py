"""Vision transformers (ViT / DeiT) with any attention mechanism.

Model (`ViT`, Dosovitskiy et al. 2021 / DeiT, Touvron et al. 2021)::

    patches = Conv(p x p, stride p)(normalise(image))        [B, h, w, E]   (h = H / p)
    x = [CLS; patches] + pos_emb                               [B, 1 + h w, E]
    repeat num_layers:  x = x + DropPath(MHA(LN(x)));  x = x + DropPath(MLP(LN(x)))
    logits = Dense(classes)(LN(x)[:, 0])                       (or the mean of the patch tokens)

The blocks are `train.models.layers.Block` (any registered mechanism). Mechanisms whose config
takes ``grid`` (the Nystrom family -- nystromformer, soft, laplacian -- and lara; ``"grid" in
la.get(name).defaults``) get ``grid=(h, w)``: their landmarks / proposals are 2-D average
pools of the patch grid (the CLS token takes no part in them), see `attention_config`.

Inputs: images as uint8/int pixels, ``[B, H, W, C]`` or flattened row-major
``[B, H * W * C]``; pixels are normalised inside the model with the ImageNet mean/std.
Mixup / CutMix run inside the model in training mode (`train.data.augment.mix_images`, rng
stream ``dropout``); the loss mixes the labels (`train.losses.vit_loss`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

import linattn_jax as la
from train.data.augment import IMAGENET_MEAN, IMAGENET_STD, mix_images

from .layers import (
    Block,
    compute_dtype,
    dense,
    layer_norm,
    learned_positions,
    prepend_cls,
)

POOLINGS = ("cls", "mean")


def attention_config(attention: str, config: Any, grid: tuple[int, int]) -> tuple:
    """The mechanism config as sorted hashable pairs, with ``grid`` added where it applies.

    ``grid=(h, w)`` (the patch grid) is added when the mechanism accepts a ``grid`` key and
    the caller did not set one; other mechanisms get the config unchanged.
    """
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    raw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    if "grid" in la.get(attention).defaults and raw.get("grid") is None:
        raw["grid"] = (int(grid[0]), int(grid[1]))
    return tuple(sorted(raw.items()))


class ViT(nn.Module):
    """ViT / DeiT classifier: images -> logits ``[B, num_classes]`` float32.

    Attributes:
      num_classes: output classes.
      image_size: ``(H, W)`` of the inputs (needed to unflatten ``[B, H*W*C]`` batches).
      channels: C.
      patch_size: p (H and W must be multiples of p).
      emb_dim, num_layers, num_heads, mlp_dim: sizes (DeiT-tiny: 192, 12, 3, 768).
      qkv_dim: total q/k/v width (default emb_dim).
      attention, attention_config: the mechanism (registry name, config pairs); ``grid``
        is filled in by `attention_config`.
      dropout_rate: dropout on embeddings and residual branches.
      drop_path_rate: stochastic depth, linearly increasing to this over the blocks.
      pooling: ``cls`` (DeiT) or ``mean`` (of the patch tokens).
      mixup_alpha, cutmix_alpha, mix_switch_prob: training-time Mixup / CutMix (`mix_images`,
        rng stream ``dropout``). When either alpha is > 0 the model returns
        ``{"logits", "mix_lam"}`` (``mix_lam = 1`` when deterministic) and the loss mixes the
        labels as ``lam y + (1 - lam) y[::-1]`` (`vit_loss`); otherwise the logits.
      dtype: computation dtype (``jnp.bfloat16`` for mixed precision; params stay float32,
        normalisation and Mixup/CutMix in float32, logits returned in float32).
    """

    num_classes: int
    image_size: tuple[int, int] = (32, 32)
    channels: int = 3
    patch_size: int = 4
    emb_dim: int = 192
    num_layers: int = 12
    num_heads: int = 3
    mlp_dim: int = 768
    qkv_dim: int | None = None
    attention: str = "softmax"
    attention_config: Any = ()
    dropout_rate: float = 0.0
    drop_path_rate: float = 0.0
    pooling: str = "cls"
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    mix_switch_prob: float = 0.5
    dtype: Any = None

    @property
    def grid(self) -> tuple[int, int]:
        h, w = self.image_size
        p = self.patch_size
        if h % p or w % p:
            raise ValueError(f"image_size {self.image_size} must be multiples of patch_size={p}")
        return h // p, w // p

    def block_attention_config(self) -> tuple:
        """The config every attention layer gets (``grid`` added where it applies)."""
        return attention_config(self.attention, self.attention_config, self.grid)

    @nn.compact
    def __call__(self, images, *, deterministic: bool = True):
        h, w = self.image_size
        c = self.channels
        if images.ndim == 2:
            if images.shape[1] != h * w * c:
                raise ValueError(
                    f"flattened images must be [B, H*W*C] = [B, {h * w * c}], got {images.shape}"
                )
            images = images.reshape(images.shape[0], h, w, c)
        if images.shape[1:] != (h, w, c):
            raise ValueError(f"images must be [B, {h}, {w}, {c}], got shape {images.shape}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        gh, gw = self.grid
        x = images.astype(jnp.float32)
        if c == 3:
            mean = jnp.asarray(IMAGENET_MEAN, jnp.float32)
            std = jnp.asarray(IMAGENET_STD, jnp.float32)
        else:
            mean, std = jnp.full((c,), 127.5, jnp.float32), jnp.full((c,), 127.5, jnp.float32)
        x = (x - mean[None, None, None, :]) / std[None, None, None, :]
        mixing = self.mixup_alpha > 0 or self.cutmix_alpha > 0
        lam = jnp.ones((), jnp.float32)
        if mixing and not deterministic:
            x, lam = mix_images(
                self.make_rng("dropout"),
                x,
                mixup_alpha=self.mixup_alpha,
                cutmix_alpha=self.cutmix_alpha,
                switch_prob=self.mix_switch_prob,
            )
        x = nn.Conv(
            self.emb_dim,
            (self.patch_size, self.patch_size),
            strides=(self.patch_size, self.patch_size),
            padding="VALID",
            kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), (None, None, None, "embed")
            ),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
            dtype=self.dtype,
            name="patch_embed",
        )(x)  # [B, gh, gw, E]
        b = x.shape[0]
        x = x.reshape(b, gh * gw, self.emb_dim)
        x = prepend_cls(self, x)
        pos = learned_positions(self, 1 + gh * gw, self.emb_dim)
        x = x + pos[None].astype(x.dtype)
        x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
        config = self.block_attention_config()
        for i in range(self.num_layers):
            rate = self.drop_path_rate * i / max(self.num_layers - 1, 1)
            x = Block(
                num_heads=self.num_heads,
                qkv_dim=self.qkv_dim or self.emb_dim,
                mlp_dim=self.mlp_dim,
                attention=self.attention,
                attention_config=config,
                dropout_rate=self.dropout_rate,
                drop_path_rate=rate,
                dtype=self.dtype,
                name=f"block_{i}",
            )(x, deterministic=deterministic)
        x = layer_norm("ln_final", self.dtype)(x)
        pooled = x[:, 0] if self.pooling == "cls" else jnp.mean(x[:, 1:], axis=1, dtype=jnp.float32)
        logits = dense(self.num_classes, "head", ("embed", "classes"), self.dtype)(pooled)
        logits = logits.astype(jnp.float32)
        return {"logits": logits, "mix_lam": lam} if mixing else logits


def build_vit(config, *, num_classes: int, image_size, channels: int = 3) -> ViT:
    """The `ViT` of ``config.model`` / ``config.attention`` / ``config.attention_config``."""
    m = config.model
    return ViT(
        num_classes=num_classes,
        image_size=tuple(image_size),
        channels=channels,
        patch_size=int(m.patch_size),
        emb_dim=int(m.emb_dim),
        num_layers=int(m.num_layers),
        num_heads=int(m.num_heads),
        mlp_dim=int(m.mlp_dim),
        qkv_dim=m.get("qkv_dim") or None,
        attention=config.attention,
        attention_config=attention_config(
            config.attention, config.attention_config, patch_grid(image_size, int(m.patch_size))
        ),
        dropout_rate=float(m.dropout_rate),
        drop_path_rate=float(m.drop_path_rate),
        pooling=m.pooling,
        dtype=compute_dtype(config),
    )


def patch_grid(image_size, patch):
    return image_size[0] // patch, image_size[1] // patch


__all__ = ["POOLINGS", "ViT", "attention_config", "build_vit", "patch_grid"]
