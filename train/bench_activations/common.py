"""Shared pieces of `train.bench_activations`: workloads, the capture of q, k, v, training."""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from train import configs
from train.data.images import ImageTask
from train.distill import capture_attention
from train.trainer import Trainer

SECTIONS = ("denominators", "stability", "laplacian", "kernels")
TINY = 1e-3  # a denominator is tiny when |den| < TINY * median |den| of its layer
SEEDS = (0, 1, 2)
MESHES = ((1, 1), (8, 1), (2, 4))
NS_ITERS = (10, 20, 30, 60)
FAKE_DEVICES = 8


class Capture(NamedTuple):
    """What one attention call saw: ``q``, ``k``, ``v`` ``[B, T, H, d]``, the key mask
    ``[B, T]`` (or None), causal, and the layer's mechanism params."""

    path: tuple[str, ...]
    q: Any
    k: Any
    v: Any
    mask: Any
    causal: bool
    params: dict


# ---------------------------------------------------------------------------- data and models
def mock_image_task(num: int, size: int, *, classes: int = 10, seed: int = 0) -> ImageTask:
    """A generated CIFAR-shaped `ImageTask` (uint8 ``[size, size, 3]``, nothing downloaded):
    pixel noise around a per-class colour and brightness, so a ViT can learn it."""
    rng = np.random.default_rng(seed)
    labels = np.arange(num) % classes
    colour = rng.uniform(40, 215, (classes, 1, 1, 3))
    imgs = colour[labels] + rng.normal(0, 40, (num, size, size, 3))
    imgs = np.clip(imgs, 0, 255).astype(np.uint8)
    recs = [{"image": img, "label": int(lab)} for img, lab in zip(imgs, labels, strict=True)]
    splits = {"train": recs, "val": recs[: num // 4], "test": recs[: num // 4]}
    return ImageTask("mock_cifar", splits, classes, (size, size), augment="none")


def workload_config(task: str, preset: str, attention: str, **model):
    """The preset config of `task` with `attention` (and its mini settings) and `model` fields."""
    c = configs.get_config(task, preset)
    configs.set_attention(c, attention)
    c.model.update(model)
    c.mesh_shape = (1, 1)
    return c


def workload_data(config, num_images: int = 256):
    """None (the workload builds its own data) or, for ViT, a `mock_image_task`."""
    if config.task != "vit":
        return None
    return mock_image_task(num_images, int(config.data.image_size))


def _subtree(tree, path):
    for name in path:
        tree = tree.get(name, {}) if hasattr(tree, "get") else {}
    return dict(tree.get("mechanism", {})) if hasattr(tree, "get") else {}


def capture(model: nn.Module, variables, *inputs) -> list[Capture]:
    """Every attention call of ``model.apply(variables, *inputs, deterministic=True)``.

    q, k, mask and causal from `train.distill.capture_attention`; v from flax's
    ``capture_intermediates`` (the ``value`` projections, matched by path and call order);
    the mechanism params (trainable and fixed) from `variables` at the layer's path.
    """
    variables = nn.meta.unbox(variables)
    calls = capture_attention(model, variables, *inputs, deterministic=True)
    _, state = model.apply(
        variables,
        *inputs,
        deterministic=True,
        capture_intermediates=lambda mdl, _: (
            isinstance(mdl, nn.DenseGeneral) and mdl.name == "value"
        ),
        mutable=["intermediates"],
    )
    used: dict[tuple, int] = {}
    out = []
    for call in calls:
        values = state["intermediates"]
        for name in (*call.path, "value", "__call__"):
            values = values[name]
        i = used[call.path] = used.get(call.path, -1) + 1
        params = {**_subtree(variables["params"], call.path)}
        params.update(_subtree(variables.get("fixed", {}), call.path))
        out.append(Capture(call.path, call.q, call.k, values[i], call.mask, call.causal, params))
    return out


def example_inputs(data, input_keys, n):
    batch = next(iter(data.train_batches(n, seed=0)))
    return [jnp.asarray(np.asarray(batch[k])[:n]) for k in input_keys]


def train_and_capture(config, steps: int, examples: int, data=None):
    """``(captures at init, captures after `steps`, losses)`` of one single-device run."""
    trainer = Trainer(config, data, devices=jax.devices()[:1])
    state = trainer.init_state()
    inputs = example_inputs(trainer.data, trainer.input_keys, examples)

    def grab(st):  # on the host: the train step donates (deletes) the state's buffers
        return jax.device_get(capture(trainer.model, {"params": st.params, **st.extra}, *inputs))

    first = grab(state)
    state, losses = run_steps(trainer, state, steps)
    return first, grab(state), losses


def run_steps(trainer, state, steps: int):
    """``(state, train losses)`` after `steps` steps of the trainer's own batch stream."""
    cfg = trainer.config
    batches = trainer.data.train_batches(int(cfg.batch_size), seed=int(cfg.data_shuffle_seed))
    losses = []
    for _ in range(steps):
        state, m = trainer.train_step(state, trainer.to_global(next(batches), trainer.train_keys))
        losses.append(m["loss"])
    return state, [float(x) for x in jax.device_get(losses)]
