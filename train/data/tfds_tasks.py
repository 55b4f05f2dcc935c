"""Text (byte-level IMDB) and Image (grayscale CIFAR-10) read with ``tfds.data_source``.

``tfds.data_source`` gives random access to an ``array_record`` build of the data set
without TensorFlow; examples are decoded and tokenised on access. Nothing is downloaded:
a data set that is not built under the tfds data dir raises ``DatasetNotFoundError`` with
the command that builds it.

Text (LRA's byte-level IMDB): tfds ``imdb_reviews`` (config ``plain_text``); as in LRA,
train = ``train`` and both val and test = ``test`` (IMDB has no validation split). Bytes
are tokenised as LRA does (``tfds.deprecated.text.ByteTextEncoder``: byte b -> b + 1,
0 = pad; ``vocab_size = 257``) by ``tokenizers.encode_bytes``, truncated/padded to
``seq_len`` (full: 4000, LRA's "4K" setting, its ``max_length`` for the 4K runs; mini:
512). Our additions, off by default: ``add_cls`` / ``add_eos`` put CLS (257) / EOS (258)
ids around the bytes, and then ``vocab_size = 259``.

Image (LRA's grayscale CIFAR-10): tfds ``cifar10``; as in LRA, train = ``train[:90%]``,
val = ``train[90%:]``, test = ``test``. RGB -> gray as ``tf.image.rgb_to_grayscale`` on
uint8 does it (weights 0.2989, 0.5870, 0.1140 in float32, then ``trunc(y * 255.5 / 255)``
back to uint8); pixels 0..255 are the tokens (``vocab_size = 256``), flattened row-major
to 1024. The mini variant average-pools 2x2 (16x16 = 256 tokens) and subsamples.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from . import config_keys
from .errors import DatasetNotFoundError
from .pipeline import LazySource, Task
from .tokenizers import BYTE_OFFSET, BYTE_VOCAB_SIZE, encode_bytes

GRAY_WEIGHTS = np.array([0.2989, 0.5870, 0.1140], dtype=np.float32)

TEXT_SEQ_LEN = {"mini": 512, "full": 4000}
TEXT_VOCAB_SIZE = BYTE_OFFSET + 256  # 257: LRA's byte ids; + CLS, EOS = BYTE_VOCAB_SIZE
# mini variants: random (seed 0) subsets of this many examples per split
MINI_SIZES = {"train": 4_000, "val": 500, "test": 500}


def tfds_data_dir(cfg: Mapping[str, Any]) -> Path:
    """``cfg["tfds_data_dir"]``, else the common ``data_dir``."""
    if cfg.get("tfds_data_dir"):
        return Path(os.path.expanduser(str(cfg["tfds_data_dir"])))
    return config_keys.data_dir(cfg)


def how_to_build(name: str, data_dir: Path) -> str:
    return (
        f"  On a machine with internet (building needs TensorFlow; training does not):\n"
        f"    pip install tensorflow tensorflow-datasets\n"
        f"    tfds build {name} --data_dir {data_dir} --file_format array_record\n"
        f"  then copy {data_dir}/{name} here (or point config.tfds_data_dir at the folder "
        f"that holds {name}/)."
    )


def open_source(name: str, split: str, data_dir: Path):
    """``tfds.data_source(name, split, data_dir, download=False)`` or a clear error.

    Works under ``tfds.testing.mock_data`` (which fakes the source): the data-set check
    runs only when tfds itself fails to open it.
    """
    import tensorflow_datasets as tfds

    try:
        return tfds.data_source(name, split=split, data_dir=str(data_dir), download=False)
    except Exception as error:  # tfds raises several types here; sort them out below
        try:
            builder = tfds.builder(name, data_dir=str(data_dir))
            prepared = builder.is_prepared()
            file_format = str(getattr(builder.info, "file_format", ""))
            where = builder.data_dir
        except Exception:  # unknown name etc.: the original error says more
            raise error from None
        if not prepared:
            raise DatasetNotFoundError(name, [where], how_to_build(name, data_dir)) from error
        if "array_record" not in file_format.lower():
            raise DatasetNotFoundError(
                f"{name} (array_record build)",
                [f"{where} (found, but in format {file_format})"],
                how_to_build(name, data_dir)
                + "\n  (tfds.data_source needs --file_format array_record.)",
            ) from error
        raise


def _subset(n: int, size: int | None, seed: int = 0) -> np.ndarray | None:
    """Sorted random subset of ``range(n)`` of ``size`` (None: everything)."""
    if size is None or size >= n:
        return None
    return np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False))


def _sizes(cfg: Mapping[str, Any]) -> dict[str, int | None]:
    mini = config_keys.variant(cfg) == "mini"
    out = {}
    for split, default in MINI_SIZES.items():
        value = cfg.get(f"num_{split}")
        out[split] = int(value) if value is not None else (default if mini else None)
    return out


# ----------------------------------------------------------------------------- text
def text_example(seq_len: int, add_cls: bool, add_eos: bool):
    def fn(record: Mapping[str, Any]) -> dict[str, np.ndarray]:
        ids = encode_bytes(record["text"], seq_len, add_cls=add_cls, add_eos=add_eos)
        return {"inputs": ids, "targets": np.int32(record["label"])}

    fn.__name__ = "imdb_bytes"
    return fn


def build_text(cfg: Mapping[str, Any]) -> Task:
    """Text (byte-level IMDB) ``Task``; see the module docstring."""
    variant = config_keys.variant(cfg)
    seq_len = config_keys.positive_int(cfg, "seq_len", TEXT_SEQ_LEN[variant])
    data_dir = tfds_data_dir(cfg)
    add_cls, add_eos = bool(cfg.get("add_cls", False)), bool(cfg.get("add_eos", False))
    fn = text_example(seq_len, add_cls, add_eos)
    train = open_source("imdb_reviews", "train", data_dir)
    test = open_source("imdb_reviews", "test", data_dir)
    sizes = _sizes(cfg)
    splits = {
        "train": LazySource(train, fn, _subset(len(train), sizes["train"])),
        "val": LazySource(test, fn, _subset(len(test), sizes["val"], seed=1)),
        "test": LazySource(test, fn, _subset(len(test), sizes["test"], seed=2)),
    }
    return Task(
        name="text",
        splits=splits,
        vocab_size=BYTE_VOCAB_SIZE if add_cls or add_eos else TEXT_VOCAB_SIZE,
        num_classes=2,
        seq_len=seq_len,
        is_pair=False,
        batch_size=config_keys.positive_int(cfg, "batch_size", 32),
        seed=int(cfg.get("seed") or 0),
        info={"source": "tfds imdb_reviews", "tfds_data_dir": str(data_dir)},
    )


# ----------------------------------------------------------------------------- image
def to_gray(rgb: np.ndarray) -> np.ndarray:
    """uint8 ``[..., H, W, 3]`` -> uint8 ``[..., H, W]`` like ``tf.image.rgb_to_grayscale``."""
    rgb = np.asarray(rgb)
    if rgb.shape[-1] == 1:
        return rgb[..., 0].astype(np.uint8)
    if rgb.shape[-1] != 3:
        raise ValueError(f"image must have 1 or 3 channels, got shape {rgb.shape}")
    gray = (rgb.astype(np.float32) * np.float32(1.0 / 255.0)) @ GRAY_WEIGHTS  # as TF does
    return np.clip(gray * np.float32(255.5), 0, 255).astype(np.uint8)


def pool(gray: np.ndarray, factor: int) -> np.ndarray:
    """Average-pool a ``[H, W]`` uint8 image by ``factor`` (rounded to nearest)."""
    if factor == 1:
        return gray
    h, w = gray.shape
    if h % factor or w % factor:
        raise ValueError(f"image {h}x{w} is not divisible by downsample={factor}")
    blocks = gray.reshape(h // factor, factor, w // factor, factor).astype(np.int32)
    return ((blocks.sum(axis=(1, 3)) + factor * factor // 2) // (factor * factor)).astype(np.uint8)


def image_example(downsample: int):
    def fn(record: Mapping[str, Any]) -> dict[str, np.ndarray]:
        gray = pool(to_gray(record["image"]), downsample)
        return {"inputs": gray.reshape(-1).astype(np.int32), "targets": np.int32(record["label"])}

    fn.__name__ = "cifar10_gray"
    return fn


def build_image(cfg: Mapping[str, Any]) -> Task:
    """Image (grayscale CIFAR-10) ``Task``; see the module docstring."""
    variant = config_keys.variant(cfg)
    downsample = config_keys.positive_int(cfg, "downsample", 2 if variant == "mini" else 1)
    if 32 % downsample:
        raise ValueError(f"downsample must divide 32, got {downsample}")
    seq_len = (32 // downsample) ** 2
    if cfg.get("seq_len") not in (None, seq_len):
        raise ValueError(
            f"image seq_len is (32 / downsample)^2 = {seq_len} with {downsample=}, "
            f"got seq_len={cfg['seq_len']}"
        )
    data_dir = tfds_data_dir(cfg)
    train = open_source("cifar10", "train", data_dir)
    test = open_source("cifar10", "test", data_dir)
    fn = image_example(downsample)
    cut = int(0.9 * len(train))
    sizes = _sizes(cfg)
    train_idx = np.arange(cut)
    val_idx = np.arange(cut, len(train))
    sub = _subset(len(train_idx), sizes["train"])
    train_idx = train_idx if sub is None else train_idx[sub]
    sub = _subset(len(val_idx), sizes["val"], seed=1)
    val_idx = val_idx if sub is None else val_idx[sub]
    splits = {
        "train": LazySource(train, fn, train_idx),
        "val": LazySource(train, fn, val_idx),
        "test": LazySource(test, fn, _subset(len(test), sizes["test"], seed=2)),
    }
    return Task(
        name="image",
        splits=splits,
        vocab_size=256,
        num_classes=10,
        seq_len=seq_len,
        is_pair=False,
        batch_size=config_keys.positive_int(cfg, "batch_size", 32),
        seed=int(cfg.get("seed") or 0),
        info={
            "source": "tfds cifar10",
            "tfds_data_dir": str(data_dir),
            "image_shape": (32 // downsample, 32 // downsample),
        },
    )
