"""``python -m train.vision``: ViT / DeiT training, the ``vit`` task of ``python -m train``.

A thin entry over the modules that do the work: the data `train.data.images` (`ImageTask`)
and `train.data.augment` (crops, RandAugment, random erasing, Mixup / CutMix), the model
`train.models.vit.ViT`, the loss `train.losses.vit_loss` and the workload table
`train.workloads` (``"vit"``). The names those modules export are re-exported here for
callers of the single-file ``train.vision`` of earlier versions.
"""

from __future__ import annotations

import sys

from train.data.augment import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    RAND_AUGMENT_FILL,
    RAND_AUGMENT_OPS,
    center_crop,
    mix_images,
    pad_crop_flip,
    rand_augment,
    rand_augment_arg,
    rand_augment_op,
    random_erasing,
    random_resized_crop,
)
from train.data.images import ImageTask, build_image_task
from train.losses import vit_loss
from train.models.vit import ViT, attention_config, build_vit

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
    "config_from_argv",
    "main",
    "mix_images",
    "pad_crop_flip",
    "rand_augment",
    "rand_augment_arg",
    "rand_augment_op",
    "random_erasing",
    "random_resized_crop",
    "vit_loss",
]


def config_from_argv(argv=None):
    """The config ``python -m train.vision <argv>`` trains (``python -m train --task vit``)."""
    from train.__main__ import config_from_argv as train_config

    return train_config(["--task", "vit", *(sys.argv[1:] if argv is None else argv)])[2]


def main(argv=None):
    """``python -m train.vision [flags of python -m train]``: the ``vit`` task of the main CLI
    (``python -m train --task vit ...``); default preset ``mini`` (CIFAR-10), e.g.
    ``python -m train.vision --preset deit_tiny --attention laplacian --set
    data.tfds_data_dir=/data/tfds``."""
    from train.__main__ import main as train_main

    argv = list(sys.argv[1:] if argv is None else argv)
    return train_main(["--task", "vit", *argv])


if __name__ == "__main__":
    from train import cli

    sys.exit(cli.run(main))
