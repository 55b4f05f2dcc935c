"""Every workload in one literal table: task name -> ``Workload(build_data, build_model, loss_fn)``.

This is the only module that imports the data (`train.data`), the models (`train.models`) and
the losses (`train.losses`) together; nothing is registered by importing a config or a model
module, so ``get_workload("lm")`` works on a fresh interpreter.

A workload is three functions::

    build_data(config)                         -> object with the train.data.Task batch API
    build_model(config, data)                  -> flax.linen Module, called as
                                                  model(*[batch[k] for k in data.input_keys],
                                                        deterministic=bool)
    loss_fn(outputs, batch, weights, config)   -> {"loss": (sum, count), ...}

(see `train.loop` for the full contract). To add one, add a row to `WORKLOADS` and a config
module to `train.configs.CONFIGS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn

from train import losses, models
from train.data import get_task
from train.data.images import ImageTask, build_image_task
from train.data.text import build_text_data

#: ``loss_fn(outputs, batch, weights [B], config) -> {name: (weighted sum, weight total)}``
LossFn = Callable[..., dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Workload:
    """How to train one kind of task: data, model and loss (see the module docstring)."""

    build_data: Callable[[Any], Any]
    build_model: Callable[[Any, Any], nn.Module]
    loss_fn: LossFn


def data_config(config) -> dict[str, Any]:
    """``config.data`` as a dict without None values, plus the global batch size and the
    shuffle seed (the keys the data builders read)."""
    cfg = {k: v for k, v in config.data.to_dict().items() if v is not None}
    cfg["batch_size"] = config.batch_size
    cfg["seed"] = config.data_shuffle_seed
    return cfg


def lra_data(config):
    """The LRA ``Task`` of ``config.task`` (`train.data.get_task`)."""
    return get_task(config.task, data_config(config))


def lra_model(config, data) -> nn.Module:
    """The LRA classifier (dual encoder for pair tasks) sized from `data`."""
    return models.build_classifier(
        config,
        vocab_size=data.vocab_size,
        num_classes=data.num_classes,
        seq_len=data.seq_len,
        is_pair=data.is_pair,
    )


def vit_data(config) -> ImageTask:
    """The `ImageTask` of ``config.data`` (ImageNet-1k or CIFAR-10)."""
    return build_image_task(data_config(config))


def vit_model(config, data: ImageTask) -> nn.Module:
    """The `ViT` sized from `data` (classes, image size, channels)."""
    return models.build_vit(
        config, num_classes=data.num_classes, image_size=data.image_size, channels=data.channels
    )


def lm_model(config, data) -> nn.Module:
    """The `CausalLM` of `config` (the byte vocabulary; `data` is not needed)."""
    del data
    return models.build_lm(config)


LRA_WORKLOAD = Workload(lra_data, lra_model, losses.lra_loss)
WORKLOADS: dict[str, Workload] = {
    "listops": LRA_WORKLOAD,
    "text": LRA_WORKLOAD,
    "retrieval": LRA_WORKLOAD,
    "image": LRA_WORKLOAD,
    "pathfinder": LRA_WORKLOAD,
    "vit": Workload(vit_data, vit_model, losses.vit_config_loss),
    "lm": Workload(build_text_data, lm_model, losses.lm_loss),
}


def get_workload(name: str) -> Workload:
    """``WORKLOADS[name]``; a clear error naming the known tasks otherwise."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown task {name!r}; registered workloads: {sorted(WORKLOADS)}")
    return WORKLOADS[name]


__all__ = [
    "LRA_WORKLOAD",
    "WORKLOADS",
    "LossFn",
    "Workload",
    "data_config",
    "get_workload",
    "lm_model",
    "lra_data",
    "lra_model",
    "vit_data",
    "vit_model",
]
