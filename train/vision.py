"""Vision transformers (ViT / DeiT) with any attention mechanism, on ImageNet-1k and CIFAR-10.

Model (`ViT`, Dosovitskiy et al. 2021 / DeiT, Touvron et al. 2021)::

    patches = Conv(p x p, stride p)(normalise(image))        [B, h, w, E]   (h = H / p)
    x = [CLS; patches] + pos_emb                               [B, 1 + h w, E]
    repeat num_layers:  x = x + DropPath(MHA(LN(x)));  x = x + DropPath(MLP(LN(x)))
    logits = Dense(classes)(LN(x)[:, 0])                       (or the mean of the patch tokens)

The attention is any registered mechanism (`train.lm.Block`, i.e.
`linattn_jax.linen.MultiHeadAttention`). Mechanisms whose config takes ``grid`` (the
Nystrom family -- nystromformer, soft, laplacian -- and lara; ``"grid" in
la.get(name).defaults``) get ``grid=(h, w)``: their landmarks / proposals are 2-D average
pools of the patch grid (the CLS token takes no part in them), see `attention_config`.

Inputs: images as uint8/int pixels, ``[B, H, W, C]`` or flattened row-major
``[B, H * W * C]``; pixels are normalised inside the model with the ImageNet mean/std.

Data (`ImageTask`): tfds ``imagenet2012`` (manual download; train / validation) or
``cifar10`` (train[:90%] / train[90%:] / test), read with ``tfds.data_source`` (no
TensorFlow at train time). Training augmentation in numpy, per example from a generator
seeded by ``(seed, stream position)`` (grain ``random_map``), so the stream is resumable:
ImageNet -- Inception-style random-resized crop (scale (0.08, 1), ratio (3/4, 4/3)) to
``image_size`` and a horizontal flip; evaluation -- resize the short side to
``image_size / 0.875`` and centre-crop. CIFAR -- 4-pixel zero-padded random crop and a
flip; evaluation -- the image. Optionally (DeiT) then RandAugment (`rand_augment`,
``rand-m9-mstd0.5-inc1``) and random erasing (`random_erasing`, 0.25), training only.
Mixup / CutMix (DeiT: 0.8 / 1.0, switch 0.5) are applied on device inside the model in
training mode (`mix_images`, rng stream ``dropout``) and the labels mixed in the loss
(`vit_loss`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import linattn_jax as la

from .data import _config
from .data.errors import DatasetNotFoundError
from .data.tfds_tasks import open_source
from .lm import Block, _dense, _layer_norm
from .models import compute_dtype

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
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
        cls = self.param(
            "cls",
            nn.with_logical_partitioning(nn.initializers.zeros_init(), (None, None, "embed")),
            (1, 1, self.emb_dim),
        )
        cls = jnp.broadcast_to(cls.astype(x.dtype), (b, 1, self.emb_dim))
        x = jnp.concatenate([cls, x], axis=1)
        pos = self.param(
            "pos_embed",
            nn.with_logical_partitioning(nn.initializers.normal(stddev=0.02), ("length", "embed")),
            (1 + gh * gw, self.emb_dim),
        )
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
        x = _layer_norm("ln_final", self.dtype)(x)
        pooled = x[:, 0] if self.pooling == "cls" else jnp.mean(x[:, 1:], axis=1, dtype=jnp.float32)
        logits = _dense(self.num_classes, "head", ("embed", "classes"), self.dtype)(pooled)
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
            config.attention, config.attention_config, _grid(image_size, int(m.patch_size))
        ),
        dropout_rate=float(m.dropout_rate),
        drop_path_rate=float(m.drop_path_rate),
        pooling=m.pooling,
        dtype=compute_dtype(config),
    )


def _grid(image_size, patch):
    return image_size[0] // patch, image_size[1] // patch


# ============================================================================ augmentation
def _resize(img: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Bilinear resize of uint8 ``[H, W, C]`` to ``size = (H', W')`` (PIL, antialiased)."""
    from PIL import Image

    if img.shape[:2] == tuple(size):
        return img
    squeeze = img.shape[-1] == 1
    pil = Image.fromarray(img[..., 0] if squeeze else img)
    out = np.asarray(pil.resize((size[1], size[0]), Image.BILINEAR))
    return out[..., None] if squeeze else out


def _as_rgb(img) -> np.ndarray:
    img = np.asarray(img)
    if img.ndim == 2:
        img = img[..., None]
    if img.dtype != np.uint8:
        img = np.clip(img, 0, 255).astype(np.uint8)
    return img


def random_resized_crop(
    img: np.ndarray,
    rng: np.random.Generator,
    size: int,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    attempts: int = 10,
) -> np.ndarray:
    """Inception-style crop: area fraction ~ U(scale), log aspect ~ U(log ratio), resized.

    Falls back to a centre crop at the clamped aspect ratio after `attempts` misses (as
    torchvision does). ``[H, W, C] uint8 -> [size, size, C] uint8``.
    """
    h, w = img.shape[:2]
    area = h * w
    for _ in range(attempts):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        cw = int(round(math.sqrt(target * aspect)))
        ch = int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            top = int(rng.integers(0, h - ch + 1))
            left = int(rng.integers(0, w - cw + 1))
            return _resize(img[top : top + ch, left : left + cw], (size, size))
    in_ratio = w / h
    if in_ratio < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif in_ratio > ratio[1]:
        ch, cw = h, int(round(h * ratio[1]))
    else:
        cw, ch = w, h
    top, left = (h - ch) // 2, (w - cw) // 2
    return _resize(img[top : top + ch, left : left + cw], (size, size))


def center_crop(img: np.ndarray, size: int, crop_fraction: float = 0.875) -> np.ndarray:
    """Resize the short side to ``size / crop_fraction`` then take the central size x size."""
    h, w = img.shape[:2]
    short = int(round(size / crop_fraction))
    if h <= w:
        nh, nw = short, max(size, int(round(w * short / h)))
    else:
        nw, nh = short, max(size, int(round(h * short / w)))
    img = _resize(img, (nh, nw))
    top, left = (nh - size) // 2, (nw - size) // 2
    return img[top : top + size, left : left + size]


def pad_crop_flip(img: np.ndarray, rng: np.random.Generator, pad: int = 4) -> np.ndarray:
    """CIFAR augmentation: zero-pad by `pad`, random crop back to the size, random flip."""
    h, w = img.shape[:2]
    padded = np.pad(img, ((pad, pad), (pad, pad), (0, 0)))
    top, left = int(rng.integers(0, 2 * pad + 1)), int(rng.integers(0, 2 * pad + 1))
    out = padded[top : top + h, left : left + w]
    return out[:, ::-1] if rng.random() < 0.5 else out


# ---------------------------------------------------------------- RandAugment, random erasing
RAND_AUGMENT_OPS = (
    "AutoContrast",
    "Equalize",
    "Invert",
    "Rotate",
    "PosterizeIncreasing",
    "SolarizeIncreasing",
    "SolarizeAdd",
    "ColorIncreasing",
    "ContrastIncreasing",
    "BrightnessIncreasing",
    "SharpnessIncreasing",
    "ShearX",
    "ShearY",
    "TranslateXRel",
    "TranslateYRel",
)
# DeiT's fill: its timm transform passes the ImageNet mean (timm's own default is 128 grey)
RAND_AUGMENT_FILL = (124, 116, 104)
MAX_MAGNITUDE = 10.0
# ops whose argument takes a random sign (timm's ``_randomly_negate``)
_UNSIGNED_OPS = ("AutoContrast", "Equalize", "Invert")
_UNSIGNED_OPS += ("PosterizeIncreasing", "SolarizeIncreasing", "SolarizeAdd")
_SIGNED_OPS = frozenset(RAND_AUGMENT_OPS) - frozenset(_UNSIGNED_OPS)


def rand_augment_arg(op: str, magnitude: float, negate: bool = False):
    """The argument of RandAugment op `op` at `magnitude` in ``[0, 10]`` (see `rand_augment`);
    `negate` flips the sign of the signed ops. None for AutoContrast / Equalize / Invert."""
    if op not in RAND_AUGMENT_OPS:
        raise ValueError(f"RandAugment op must be one of {RAND_AUGMENT_OPS}, got {op!r}")
    level = float(magnitude) / MAX_MAGNITUDE
    sign = -1.0 if negate else 1.0
    if op == "Rotate":
        return sign * level * 30.0
    if op == "PosterizeIncreasing":
        return 4 - int(level * 4)
    if op == "SolarizeIncreasing":
        return 256 - int(level * 256)
    if op == "SolarizeAdd":
        return int(level * 110)
    if op.endswith("Increasing"):  # Color / Contrast / Brightness / Sharpness
        return max(0.1, 1.0 + sign * level * 0.9)
    if op in ("ShearX", "ShearY"):
        return sign * level * 0.3
    if op in ("TranslateXRel", "TranslateYRel"):
        return sign * level * 0.45
    return None


def _to_pil(img: np.ndarray):
    from PIL import Image

    img = np.asarray(img)
    if img.dtype != np.uint8 or img.ndim != 3 or img.shape[-1] not in (1, 3):
        raise ValueError(f"want a uint8 [H, W, C] image with C 1 or 3, got {img.dtype} {img.shape}")
    return Image.fromarray(np.ascontiguousarray(img[..., 0] if img.shape[-1] == 1 else img))


def _from_pil(pil) -> np.ndarray:
    out = np.array(pil, dtype=np.uint8)
    return out[..., None] if out.ndim == 2 else out


def _apply_op(pil, op: str, arg, fill):
    """One RandAugment op on a PIL image (mode ``L`` or ``RGB``) with its argument `arg`."""
    from PIL import Image, ImageEnhance, ImageOps

    fill = int(round(sum(fill) / len(fill))) if pil.mode == "L" else tuple(int(v) for v in fill)
    bands = len(pil.getbands())
    geometric = {"resample": Image.BICUBIC, "fillcolor": fill}
    w, h = pil.size
    if op == "AutoContrast":
        return ImageOps.autocontrast(pil)
    if op == "Equalize":
        return ImageOps.equalize(pil)
    if op == "Invert":
        return ImageOps.invert(pil)
    if op == "Rotate":  # counter-clockwise about the centre
        return pil.rotate(arg, **geometric)
    if op == "PosterizeIncreasing":  # keep the top `arg` bits (0 bits: black)
        mask = (0xFF << (8 - arg)) & 0xFF
        return pil.point([i & mask for i in range(256)] * bands)
    if op == "SolarizeIncreasing":
        return ImageOps.solarize(pil, arg)  # 255 - x where x >= arg
    if op == "SolarizeAdd":
        return pil.point([min(255, i + arg) if i < 128 else i for i in range(256)] * bands)
    if op.endswith("Increasing"):
        return getattr(ImageEnhance, op[: -len("Increasing")])(pil).enhance(arg)
    # affine: output pixel (x, y) samples the input at (a x + b y + c, d x + e y + f)
    coeffs = {
        "ShearX": (1, arg, 0, 0, 1, 0),
        "ShearY": (1, 0, 0, arg, 1, 0),
        "TranslateXRel": (1, 0, arg * w, 0, 1, 0),
        "TranslateYRel": (1, 0, 0, 0, 1, arg * h),
    }[op]
    return pil.transform(pil.size, Image.Transform.AFFINE, coeffs, **geometric)


def rand_augment_op(
    img: np.ndarray,
    op: str,
    magnitude: float,
    *,
    negate: bool = False,
    fill: tuple[int, ...] = RAND_AUGMENT_FILL,
) -> np.ndarray:
    """One op of `rand_augment` at a fixed magnitude and sign: uint8 ``[H, W, C] -> [H, W, C]``."""
    return _from_pil(_apply_op(_to_pil(img), op, rand_augment_arg(op, magnitude, negate), fill))


def rand_augment(
    img: np.ndarray,
    rng: np.random.Generator,
    *,
    num_ops: int = 2,
    magnitude: float = 9.0,
    magnitude_std: float = 0.5,
    prob: float = 0.5,
    fill: tuple[int, ...] = RAND_AUGMENT_FILL,
) -> np.ndarray:
    """RandAugment (Cubuk et al. 2020) as in DeiT: timm's ``rand-m9-mstd0.5-inc1``.

    Draws `num_ops` ops uniformly with replacement from `RAND_AUGMENT_OPS` (timm's
    "increasing" set); each is applied with probability `prob` at a magnitude drawn from
    ``N(magnitude, magnitude_std)`` (fixed when ``magnitude_std = 0``) clipped to
    ``[0, 10]``; the ops marked ± take a random sign. Level ``l = m / 10``:

    ====================  ==================================================  ==============
    op                    argument at magnitude m                             m = 9
    ====================  ==================================================  ==============
    AutoContrast          -- (stretch each channel to 0..255)                 --
    Equalize              -- (histogram equalisation per channel)             --
    Invert                -- (255 - x)                                        --
    Rotate                ± 30 l degrees, about the centre                    ± 27
    PosterizeIncreasing   keep the top ``4 - int(4 l)`` bits                  1 bit
    SolarizeIncreasing    ``255 - x`` where ``x >= 256 - int(256 l)``         x >= 26
    SolarizeAdd           ``min(x + int(110 l), 255)`` where ``x < 128``      + 99
    ColorIncreasing       saturation factor ``max(0.1, 1 ± 0.9 l)``           0.19 / 1.81
    ContrastIncreasing    contrast factor, as Color                           0.19 / 1.81
    BrightnessIncreasing  brightness factor, as Color                         0.19 / 1.81
    SharpnessIncreasing   sharpness factor, as Color                          0.19 / 1.81
    ShearX / ShearY       shear ± 0.3 l (about the top-left corner)           ± 0.27
    TranslateXRel / YRel  shift ± 0.45 l of the width / height                ± 0.405
    ====================  ==================================================  ==============

    Factors are PIL ``ImageEnhance`` blends (1 = identity). Geometric ops resample
    bicubically (DeiT's interpolation) and fill uncovered pixels with `fill`. Magnitude 0 is
    the identity for every op but AutoContrast, Equalize, Invert and Posterize (4 bits).
    ``uint8 [H, W, C] -> uint8 [H, W, C]``, C 1 (PIL mode ``L``, fill the mean of `fill`)
    or 3.
    """
    pil = _to_pil(img)
    for i in rng.integers(0, len(RAND_AUGMENT_OPS), size=int(num_ops)):
        if rng.random() >= prob:
            continue
        m = float(magnitude)
        if magnitude_std > 0:
            m = float(rng.normal(magnitude, magnitude_std))
        m = min(max(m, 0.0), MAX_MAGNITUDE)
        op = RAND_AUGMENT_OPS[int(i)]
        negate = op in _SIGNED_OPS and rng.random() < 0.5
        pil = _apply_op(pil, op, rand_augment_arg(op, m, negate), fill)
    return _from_pil(pil)


def _pixel_stats(channels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel (mean, std) in 0..255 units, as `ViT` normalises C channels."""
    if channels == 3:
        return np.asarray(IMAGENET_MEAN, np.float32), np.asarray(IMAGENET_STD, np.float32)
    return np.full((channels,), 127.5, np.float32), np.full((channels,), 127.5, np.float32)


def random_erasing(
    img: np.ndarray,
    rng: np.random.Generator,
    *,
    prob: float = 0.25,
    area: tuple[float, float] = (0.02, 1 / 3),
    ratio: tuple[float, float] = (0.3, 1 / 0.3),
    attempts: int = 10,
) -> np.ndarray:
    """DeiT's random erasing (Zhong et al. 2020; timm ``RandomErasing(0.25, mode="pixel")``).

    With probability `prob`, one rectangle -- area fraction ~ U(area), log aspect (h / w) ~
    U(log ratio), rounded sides, strictly inside the image, up to `attempts` draws (none
    erased if all miss) -- is filled with per-pixel noise. timm draws N(0, 1) on the
    normalised image; our pipeline emits pixels and `ViT` normalises, so a uint8 image gets
    the equivalent ``round(clip(mean_c + std_c * N(0, 1), 0, 255))`` with the channel's
    mean / std in pixel units (`IMAGENET_MEAN` / `IMAGENET_STD`; 127.5 / 127.5 unless C = 3).
    The clip truncates the tails (the representable range is -2.1..2.2 sigma for red,
    -1.8..2.6 for blue; -1..1 when C != 3), so after normalisation the fill has mean
    0.002-0.013 and std 0.965-0.975 (C != 3: 0 and 0.72) instead of 0 and 1.
    A float image is taken as already normalised and gets N(0, 1) (timm exactly).
    ``[H, W, C] -> [H, W, C]``, same dtype (a copy when erased).
    """
    if rng.random() >= prob:
        return img
    h, w, c = img.shape
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(attempts):
        target = h * w * rng.uniform(*area)
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        eh = int(round(math.sqrt(target * aspect)))
        ew = int(round(math.sqrt(target / aspect)))
        if 0 < eh < h and 0 < ew < w:
            top = int(rng.integers(0, h - eh + 1))
            left = int(rng.integers(0, w - ew + 1))
            noise = rng.standard_normal((eh, ew, c), dtype=np.float32)
            if np.issubdtype(img.dtype, np.floating):
                patch = noise.astype(img.dtype)
            else:
                mean, std = _pixel_stats(c)
                patch = np.clip(np.rint(mean + std * noise), 0, 255).astype(img.dtype)
            out = np.array(img, copy=True)
            out[top : top + eh, left : left + ew] = patch
            return out
    return img


# ============================================================================ data
@dataclasses.dataclass(frozen=True, eq=False)
class ImageTask:
    """An image classification data set with the ``train.data.Task`` batch API.

    Batches: ``inputs`` uint8 ``[B, H, W, C]`` pixels (or, with ``flatten=True``, int32
    ``[B, H * W * C]`` rows, the LRA token layout), ``targets`` int32 ``[B]``; evaluation batches
    add ``mask`` bool ``[B]``. The training stream is a pure function of
    ``(seed, batch_size, step)`` (shuffle by grain, augmentation from the stream position).

    Attributes:
      name: ``imagenet2012`` or ``cifar10``.
      splits: split -> random-access source of ``{"image", "label"}`` records.
      num_classes: classes.
      image_size: ``(H, W)`` of the batches.
      channels: C.
      augment: ``"inception"`` (ImageNet), ``"pad_crop"`` (CIFAR) or ``"none"``.
      randaugment: ``(num_ops, magnitude, magnitude_std)`` of `rand_augment` (DeiT:
        ``(2, 9, 0.5)``) or None; applied to training examples after `augment`.
      random_erasing: probability of `random_erasing` (DeiT: 0.25), after RandAugment.
      flatten: batches hold int32 ``[B, H*W*C]`` pixel rows instead of uint8 images.
    """

    name: str
    splits: Mapping[str, Any]
    num_classes: int
    image_size: tuple[int, int]
    channels: int = 3
    augment: str = "pad_crop"
    randaugment: tuple[int, float, float] | None = None
    random_erasing: float = 0.0
    flatten: bool = False
    crop_fraction: float = 0.875
    batch_size: int = 32
    seed: int = 0
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    input_keys = ("inputs",)
    is_pair = False

    def __post_init__(self):
        object.__setattr__(self, "randaugment", _randaugment_arg(self.randaugment, "randaugment"))
        object.__setattr__(
            self, "random_erasing", _probability_arg(self.random_erasing, "random_erasing")
        )

    @property
    def seq_len(self) -> int:
        """Length of a flattened image (what the loop's dummy inputs are sized by)."""
        return self.image_size[0] * self.image_size[1] * self.channels

    def source(self, split: str):
        if split not in self.splits:
            raise KeyError(f"task {self.name!r} has no split {split!r}; has {list(self.splits)}")
        return self.splits[split]

    def num_examples(self, split: str) -> int:
        return len(self.source(split))

    def steps_per_epoch(self, batch_size: int | None = None, split: str = "train") -> int:
        return self.num_examples(split) // (batch_size or self.batch_size)

    # -------------------------------------------------------------- per-example transforms
    def _finish(self, img: np.ndarray, label) -> dict[str, np.ndarray]:
        if img.shape[-1] != self.channels:
            if self.channels == 3 and img.shape[-1] == 1:
                img = np.repeat(img, 3, axis=-1)
            else:
                raise ValueError(
                    f"{self.name}: image has shape {img.shape}, want C={self.channels}"
                )
        img = np.ascontiguousarray(img, dtype=np.uint8)
        if self.flatten:
            img = img.reshape(-1).astype(np.int32)
        return {"inputs": img, "targets": np.int32(label)}

    def train_example(self, record, rng: np.random.Generator) -> dict[str, np.ndarray]:
        img = _as_rgb(record["image"])
        size = self.image_size[0]
        if self.augment == "inception":
            img = random_resized_crop(img, rng, size)
            if rng.random() < 0.5:
                img = img[:, ::-1]
        elif self.augment == "pad_crop":
            img = pad_crop_flip(_resize(img, self.image_size), rng)
        elif self.augment == "none":
            img = _resize(img, self.image_size)
        else:
            raise ValueError(f"augment must be inception, pad_crop or none, got {self.augment!r}")
        if self.randaugment is not None:
            num_ops, magnitude, magnitude_std = self.randaugment
            img = rand_augment(
                img,
                rng,
                num_ops=num_ops,
                magnitude=magnitude,
                magnitude_std=magnitude_std,
            )
        if self.random_erasing > 0:
            img = random_erasing(img, rng, prob=self.random_erasing)
        return self._finish(img, record["label"])

    def eval_example(self, record) -> dict[str, np.ndarray]:
        img = _as_rgb(record["image"])
        if self.augment == "inception":
            img = center_crop(img, self.image_size[0], self.crop_fraction)
        else:
            img = _resize(img, self.image_size)
        return self._finish(img, record["label"])

    # -------------------------------------------------------------- batches
    def _collate(self, examples):
        return {
            "inputs": np.stack([e["inputs"] for e in examples]),
            "targets": np.asarray([e["targets"] for e in examples], np.int32),
        }

    def train_dataset(
        self, batch_size=None, *, seed=None, split="train", process_index=0, process_count=1
    ):
        """The endless augmented stream as a ``grain.MapDataset`` of (per-process) batches."""
        import grain

        from .data.pipeline import _check_process, shuffle_seed

        batch_size = batch_size or self.batch_size
        seed = self.seed if seed is None else seed
        local = _check_process(batch_size, process_index, process_count)
        src = self.source(split)
        if len(src) == 0:
            raise ValueError(f"task {self.name!r} split {split!r} is empty")
        ds = grain.MapDataset.source(src).shuffle(seed=shuffle_seed(seed)).repeat()
        # the augmentation generator is seeded by (seed, position in the global stream)
        ds = ds.random_map(self.train_example, seed=shuffle_seed(seed + 1))
        if process_count > 1:
            ds = ds[process_index::process_count]
        return ds.batch(local, drop_remainder=True, batch_fn=self._collate)

    def train_batch(self, step: int, batch_size=None, **kwargs):
        return self.train_dataset(batch_size, **kwargs)[int(step)]

    def train_batches(
        self,
        batch_size=None,
        *,
        seed=None,
        start_step=0,
        split="train",
        num_threads=0,
        prefetch=2,
        process_index=0,
        process_count=1,
    ) -> Iterator[dict[str, np.ndarray]]:
        """Endless training batches from ``start_step`` (same contract as ``Task``)."""
        import grain

        ds = self.train_dataset(
            batch_size,
            seed=seed,
            split=split,
            process_index=process_index,
            process_count=process_count,
        )
        if start_step:
            ds = ds[int(start_step) :]
        options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
        return iter(ds.to_iter_dataset(options))

    def num_eval_batches(self, split: str, batch_size=None) -> int:
        return math.ceil(self.num_examples(split) / (batch_size or self.batch_size))

    def eval_batches(
        self, split: str, batch_size=None, *, process_index=0, process_count=1
    ) -> Iterator[dict[str, np.ndarray]]:
        """One ordered pass over `split`; the last batch padded, flagged by ``mask``."""
        from .data.pipeline import _check_process

        batch_size = batch_size or self.batch_size
        local = _check_process(batch_size, process_index, process_count)
        src = self.source(split)
        n = len(src)
        if n == 0:
            return
        blank = None
        for b in range(self.num_eval_batches(split, batch_size)):
            positions = b * batch_size + process_index + process_count * np.arange(local)
            rows = []
            for p in positions:
                if p < n:
                    rows.append(self.eval_example(src[int(p)]))
                else:
                    if blank is None:
                        first = rows[0] if rows else self.eval_example(src[0])
                        blank = {k: np.zeros_like(v) for k, v in first.items()}
                    rows.append(blank)
            batch = self._collate(rows)
            batch["mask"] = positions < n
            yield batch


class _Subset:
    """``src[indices[i]]``: a random-access view of a subset of a source."""

    def __init__(self, src, indices):
        self.src, self.indices = src, np.asarray(indices, np.int64)

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        return self.src[int(self.indices[int(i)])]


def _randaugment_arg(value, key: str) -> tuple[int, float, float] | None:
    """`value` as ``(num_ops, magnitude, magnitude_std)``, checked, or None."""
    if value is None:
        return None
    msg = (
        f"{key} must be None or (num_ops, magnitude, magnitude_std) with num_ops a positive "
        f"int, magnitude in [0, {MAX_MAGNITUDE:g}] and magnitude_std a finite number >= 0 "
        f"(DeiT: (2, 9, 0.5)), got {value!r}"
    )
    try:
        num_ops, magnitude, magnitude_std = value
    except (TypeError, ValueError):
        raise ValueError(msg) from None
    numbers = (int, float, np.integer, np.floating)
    if (
        any(isinstance(v, bool) or not isinstance(v, numbers) for v in value)
        or int(num_ops) != num_ops
        or num_ops < 1
        or not 0 <= magnitude <= MAX_MAGNITUDE
        or not (math.isfinite(magnitude_std) and magnitude_std >= 0)
    ):
        raise ValueError(msg)
    return int(num_ops), float(magnitude), float(magnitude_std)


def _probability_arg(value, key: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not 0 <= value <= 1
    ):
        raise ValueError(f"{key} must be a probability in [0, 1] (0 = off), got {value!r}")
    return float(value)


def _subset(src, size, seed):
    if size is None or size >= len(src):
        return src
    idx = np.sort(np.random.default_rng(seed).choice(len(src), size=size, replace=False))
    return _Subset(src, idx)


def build_image_task(cfg: Mapping[str, Any]) -> ImageTask:
    """`ImageTask` for ``cfg["dataset"]`` (``imagenet2012`` or ``cifar10``).

    Keys (all optional): ``dataset``, ``image_size`` (default 224 / 32), ``data_dir`` /
    ``tfds_data_dir`` (the tfds data dir; ImageNet must be built there from the manual
    download), ``num_train`` / ``num_val`` / ``num_test`` (random subsets), ``augment``,
    ``crop_fraction``, ``randaugment`` (None or ``(num_ops, magnitude, magnitude_std)``),
    ``random_erasing`` (a probability), ``batch_size``, ``seed``, ``flatten``.

    Raises:
      DatasetNotFoundError: the data set is not built under the tfds data dir.
    """
    from .data.tfds_tasks import tfds_data_dir

    name = cfg.get("dataset") or "cifar10"
    randaugment = _randaugment_arg(cfg.get("randaugment"), "config 'randaugment'")
    erasing = cfg.get("random_erasing")
    erasing = _probability_arg(0.0 if erasing is None else erasing, "config 'random_erasing'")
    data_dir = tfds_data_dir(cfg)
    if name == "imagenet2012":
        size = int(cfg.get("image_size") or 224)
        try:
            train = open_source(name, "train", data_dir)
            val = open_source(name, "validation", data_dir)
        except DatasetNotFoundError as e:
            raise DatasetNotFoundError(
                e.dataset,
                e.looked_in,
                "  ImageNet needs a manual download (https://image-net.org, ILSVRC2012):\n"
                "    put ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar in MANUAL_DIR,\n"
                f"    tfds build imagenet2012 --manual_dir MANUAL_DIR --data_dir {data_dir} "
                "--file_format array_record\n"
                "  (building needs TensorFlow; training reads the array_record files without it),\n"
                "  or point config data.tfds_data_dir at a folder that holds imagenet2012/.",
            ) from e
        splits = {"train": train, "val": val, "test": val}
        num_classes, augment = 1000, cfg.get("augment") or "inception"
    elif name == "cifar10":
        size = int(cfg.get("image_size") or 32)
        train = open_source(name, "train", data_dir)
        test = open_source(name, "test", data_dir)
        cut = int(0.9 * len(train))
        splits = {
            "train": _Subset(train, np.arange(cut)),
            "val": _Subset(train, np.arange(cut, len(train))),
            "test": test,
        }
        num_classes, augment = 10, cfg.get("augment") or "pad_crop"
    else:
        raise ValueError(f"dataset must be 'imagenet2012' or 'cifar10', got {name!r}")
    splits = {
        s: _subset(src, cfg.get(f"num_{s}"), seed=i) for i, (s, src) in enumerate(splits.items())
    }
    return ImageTask(
        name=name,
        splits=splits,
        num_classes=num_classes,
        image_size=(size, size),
        augment=augment,
        randaugment=randaugment,
        random_erasing=erasing,
        flatten=bool(cfg.get("flatten", False)),
        crop_fraction=float(cfg.get("crop_fraction") or 0.875),
        batch_size=_config.positive_int(cfg, "batch_size", 32),
        seed=int(cfg.get("seed") or 0),
        info={"source": f"tfds {name}", "tfds_data_dir": str(data_dir)},
    )


# ============================================================================ loss
def mix_images(rng, images, *, mixup_alpha=0.8, cutmix_alpha=1.0, switch_prob=0.5):
    """Mixup / CutMix of a batch with its reverse ``images[::-1]`` (DeiT's recipe, one lam
    per batch).

    Args:
      rng: a jax key.
      images: ``[B, H, W, C]`` float.
    Returns:
      ``(mixed [B, H, W, C], lam [])``: with probability `switch_prob` (always when
      ``mixup_alpha == 0``) CutMix -- a box of area ``1 - lam``, lam ~ Beta(cutmix_alpha,
      cutmix_alpha), pasted from the reversed batch, lam corrected to the clipped box's
      area -- else Mixup ``lam x + (1 - lam) x[::-1]``, lam ~ Beta(mixup_alpha,
      mixup_alpha). The labels mix with the same lam: ``lam y + (1 - lam) y[::-1]``.
    """
    if mixup_alpha <= 0 and cutmix_alpha <= 0:
        return images, jnp.ones((), jnp.float32)
    k_switch, k_mix, k_cut, k_pos = jax.random.split(rng, 4)
    b, h, w, _ = images.shape
    flipped = images[::-1]
    lam_mix = jnp.ones((), jnp.float32)
    if mixup_alpha > 0:
        lam_mix = jax.random.beta(k_mix, mixup_alpha, mixup_alpha)
    mixed = lam_mix * images + (1.0 - lam_mix) * flipped
    if cutmix_alpha <= 0:
        return mixed, lam_mix
    lam_cut = jax.random.beta(k_cut, cutmix_alpha, cutmix_alpha)
    # box of area (1 - lam) H W centred uniformly, clipped to the image
    side = jnp.sqrt(1.0 - lam_cut)
    cy, cx = jax.random.uniform(k_pos, (2,)) * jnp.asarray([h, w], jnp.float32)
    y0, y1 = jnp.clip(cy - side * h / 2, 0, h), jnp.clip(cy + side * h / 2, 0, h)
    x0, x1 = jnp.clip(cx - side * w / 2, 0, w), jnp.clip(cx + side * w / 2, 0, w)
    ys = jnp.arange(h, dtype=jnp.float32) + 0.5
    xs = jnp.arange(w, dtype=jnp.float32) + 0.5
    box = ((ys[:, None] >= y0) & (ys[:, None] < y1)) & ((xs[None, :] >= x0) & (xs[None, :] < x1))
    lam_box = 1.0 - jnp.mean(box.astype(jnp.float32))
    cut = jnp.where(box[None, :, :, None], flipped, images)
    use_cut = jnp.asarray(True)
    if mixup_alpha > 0:
        use_cut = jax.random.uniform(k_switch) < switch_prob
    return jnp.where(use_cut, cut, mixed), jnp.where(use_cut, lam_box, lam_mix)


def vit_loss(outputs, batch, weights, *, label_smoothing: float = 0.0):
    """Cross-entropy (label smoothing, Mixup/CutMix-mixed labels) and top-1 / top-5 accuracy.

    `outputs`: logits ``[B, K]`` or ``{"logits", "mix_lam"}`` (see `ViT`); ``batch["targets"]``
    int ``[B]``; `weights` ``[B]`` (0 on eval padding). Returns the loop's
    ``{name: (weighted sum, weight total)}``; accuracy is against the unmixed labels.
    """
    if isinstance(outputs, Mapping):
        logits, lam = outputs["logits"], outputs["mix_lam"]
    else:
        logits, lam = outputs, jnp.ones((), jnp.float32)
    targets = batch["targets"]
    k = logits.shape[-1]
    onehot = jax.nn.one_hot(targets, k, dtype=jnp.float32)
    if label_smoothing:
        onehot = onehot * (1.0 - label_smoothing) + label_smoothing / k
    soft = lam * onehot + (1.0 - lam) * onehot[::-1]
    ce = -jnp.sum(soft * jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), axis=-1)
    top1 = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    count = jnp.sum(weights)
    out = {"loss": (jnp.sum(ce * weights), count), "accuracy": (jnp.sum(top1 * weights), count)}
    if k > 5:
        top5 = jnp.any(jax.lax.top_k(logits, 5)[1] == targets[:, None], axis=-1)
        out["top5"] = (jnp.sum(top5.astype(jnp.float32) * weights), count)
    return out


# ============================================================================ workload
def _vit_data(config) -> ImageTask:
    cfg = {k: v for k, v in config.data.to_dict().items() if v is not None}
    cfg["batch_size"] = config.batch_size
    cfg["seed"] = config.data_shuffle_seed
    return build_image_task(cfg)


def _vit_model(config, data: ImageTask) -> ViT:
    return build_vit(
        config, num_classes=data.num_classes, image_size=data.image_size, channels=data.channels
    )


def _vit_loss(outputs, batch, weights, config):
    return vit_loss(outputs, batch, weights, label_smoothing=float(config.label_smoothing))


def register_workload() -> None:
    """Adds the ``vit`` workload to `train.loop.WORKLOADS` (idempotent; done on import)."""
    from train import loop

    loop.WORKLOADS.setdefault("vit", loop.Workload(_vit_data, _vit_model, _vit_loss))


register_workload()


__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ImageTask",
    "RAND_AUGMENT_FILL",
    "RAND_AUGMENT_OPS",
    "ViT",
    "attention_config",
    "build_image_task",
    "build_vit",
    "center_crop",
    "mix_images",
    "pad_crop_flip",
    "rand_augment",
    "rand_augment_arg",
    "rand_augment_op",
    "random_erasing",
    "random_resized_crop",
    "register_workload",
    "vit_loss",
]


def main(argv=None):
    """``python -m train.vision [flags of python -m train]``: the ``vit`` task of the main CLI
    (``python -m train --task vit ...``); default preset ``mini`` (CIFAR-10), e.g.
    ``python -m train.vision --preset deit_tiny --attention laplacian --set
    data.tfds_data_dir=/data/tfds``."""
    import sys

    from train.__main__ import main as train_main

    argv = list(sys.argv[1:] if argv is None else argv)
    return train_main(["--task", "vit", *argv])


if __name__ == "__main__":
    main()
