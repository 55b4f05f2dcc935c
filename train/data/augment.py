"""Image augmentation: crops, RandAugment, random erasing (numpy, per example) and Mixup / CutMix
(jax, per batch, on device).

Training augmentation runs in numpy on one example at a time, from a generator seeded by
``(seed, stream position)`` (grain ``random_map``), so the stream is resumable: ImageNet --
Inception-style random-resized crop (scale (0.08, 1), ratio (3/4, 4/3)) and a horizontal flip;
evaluation -- resize the short side to ``image_size / 0.875`` and centre-crop. CIFAR -- 4-pixel
zero-padded random crop and a flip. Optionally (DeiT) then RandAugment (`rand_augment`,
``rand-m9-mstd0.5-inc1``) and random erasing (`random_erasing`, 0.25), training only. Mixup /
CutMix (DeiT: 0.8 / 1.0, switch 0.5) are applied on device inside the ViT in training mode
(`mix_images`) and the labels mixed in the loss (`train.losses.vit_loss`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

#: the ImageNet per-channel pixel mean / std (0..255 units) the ViT normalises with
IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def resize(img: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Bilinear resize of uint8 ``[H, W, C]`` to ``size = (H', W')`` (PIL, antialiased)."""
    from PIL import Image

    if img.shape[:2] == tuple(size):
        return img
    squeeze = img.shape[-1] == 1
    pil = Image.fromarray(img[..., 0] if squeeze else img)
    out = np.asarray(pil.resize((size[1], size[0]), Image.BILINEAR))
    return out[..., None] if squeeze else out


def as_rgb(img) -> np.ndarray:
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
            return resize(img[top : top + ch, left : left + cw], (size, size))
    in_ratio = w / h
    if in_ratio < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif in_ratio > ratio[1]:
        ch, cw = h, int(round(h * ratio[1]))
    else:
        cw, ch = w, h
    top, left = (h - ch) // 2, (w - cw) // 2
    return resize(img[top : top + ch, left : left + cw], (size, size))


def center_crop(img: np.ndarray, size: int, crop_fraction: float = 0.875) -> np.ndarray:
    """Resize the short side to ``size / crop_fraction`` then take the central size x size."""
    h, w = img.shape[:2]
    short = int(round(size / crop_fraction))
    if h <= w:
        nh, nw = short, max(size, int(round(w * short / h)))
    else:
        nw, nh = short, max(size, int(round(h * short / w)))
    img = resize(img, (nh, nw))
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


def randaugment_arg(value, key: str) -> tuple[int, float, float] | None:
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


def probability_arg(value, key: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not 0 <= value <= 1
    ):
        raise ValueError(f"{key} must be a probability in [0, 1] (0 = off), got {value!r}")
    return float(value)


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


__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "MAX_MAGNITUDE",
    "RAND_AUGMENT_FILL",
    "RAND_AUGMENT_OPS",
    "as_rgb",
    "center_crop",
    "mix_images",
    "pad_crop_flip",
    "probability_arg",
    "rand_augment",
    "rand_augment_arg",
    "rand_augment_op",
    "random_erasing",
    "random_resized_crop",
    "randaugment_arg",
    "resize",
]
