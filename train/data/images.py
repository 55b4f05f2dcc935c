"""Image classification data (`ImageTask`): ImageNet-1k and CIFAR-10 from tfds.

tfds ``imagenet2012`` (manual download; train / validation) or ``cifar10`` (train[:90%] /
train[90%:] / test), read with ``tfds.data_source`` (no TensorFlow at train time). The
training stream is augmented per example by `train.data.augment` (crops, RandAugment, random
erasing) from a generator seeded by ``(seed, stream position)``, so it is resumable.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from . import config_keys
from .augment import (
    as_rgb,
    center_crop,
    pad_crop_flip,
    probability_arg,
    rand_augment,
    randaugment_arg,
    random_erasing,
    random_resized_crop,
    resize,
)
from .errors import DatasetNotFoundError
from .pipeline import SplitAccess, check_process, iterate_from, shuffle_seed
from .tfds_tasks import open_source, tfds_data_dir


@dataclasses.dataclass(frozen=True, eq=False)
class ImageTask(SplitAccess):
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
    # repr=False: grain names every pipeline step by its repr; in-memory splits would be
    # formatted in full each time a stream is built.
    splits: Mapping[str, Any] = dataclasses.field(repr=False)
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
        object.__setattr__(self, "randaugment", randaugment_arg(self.randaugment, "randaugment"))
        object.__setattr__(
            self, "random_erasing", probability_arg(self.random_erasing, "random_erasing")
        )

    @property
    def seq_len(self) -> int:
        """Length of a flattened image (what the loop's dummy inputs are sized by)."""
        return self.image_size[0] * self.image_size[1] * self.channels

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
        img = as_rgb(record["image"])
        size = self.image_size[0]
        if self.augment == "inception":
            img = random_resized_crop(img, rng, size)
            if rng.random() < 0.5:
                img = img[:, ::-1]
        elif self.augment == "pad_crop":
            img = pad_crop_flip(resize(img, self.image_size), rng)
        elif self.augment == "none":
            img = resize(img, self.image_size)
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
        img = as_rgb(record["image"])
        if self.augment == "inception":
            img = center_crop(img, self.image_size[0], self.crop_fraction)
        else:
            img = resize(img, self.image_size)
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

        batch_size = batch_size or self.batch_size
        seed = self.seed if seed is None else seed
        local = check_process(batch_size, process_index, process_count)
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
        ds = self.train_dataset(
            batch_size,
            seed=seed,
            split=split,
            process_index=process_index,
            process_count=process_count,
        )
        return iterate_from(ds, start_step, num_threads=num_threads, prefetch=prefetch)

    def num_eval_batches(self, split: str, batch_size=None) -> int:
        return math.ceil(self.num_examples(split) / (batch_size or self.batch_size))

    def eval_batches(
        self, split: str, batch_size=None, *, process_index=0, process_count=1
    ) -> Iterator[dict[str, np.ndarray]]:
        """One ordered pass over `split`; the last batch padded, flagged by ``mask``."""

        batch_size = batch_size or self.batch_size
        local = check_process(batch_size, process_index, process_count)
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

    name = cfg.get("dataset") or "cifar10"
    randaugment = randaugment_arg(cfg.get("randaugment"), "config 'randaugment'")
    erasing = cfg.get("random_erasing")
    erasing = probability_arg(0.0 if erasing is None else erasing, "config 'random_erasing'")
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
        batch_size=config_keys.positive_int(cfg, "batch_size", 32),
        seed=int(cfg.get("seed") or 0),
        info={"source": f"tfds {name}", "tfds_data_dir": str(data_dir)},
    )


__all__ = ["ImageTask", "build_image_task"]
