"""Loss functions of the workloads: ``loss_fn(outputs, batch, weights, config) -> {name:
(weighted sum, weight total)}`` (the loop sums both over batches and divides at the end).

- `classification_loss`: LRA classifiers (cross-entropy with label smoothing, accuracy);
- `vit_loss`: ViT / DeiT (Mixup/CutMix-mixed labels, top-1 / top-5);
- `lm_loss`: causal LM (NLL per target byte, next-byte accuracy, bits per byte), with
  `token_nll` and `perplexity`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import optax

_f32 = jnp.float32


def classification_loss(logits, batch, weights, *, label_smoothing: float = 0.0):
    """Cross-entropy and accuracy of ``logits [B, C]`` against ``batch["targets"] [B]``.

    Returns ``{"loss": (sum_b w_b ce_b, sum_b w_b), "accuracy": (sum_b w_b 1[argmax=y], ...)}``.
    """
    targets = batch["targets"]
    num_classes = logits.shape[-1]
    onehot = jax.nn.one_hot(targets, num_classes, dtype=jnp.float32)
    if label_smoothing:
        onehot = onehot * (1.0 - label_smoothing) + label_smoothing / num_classes
    ce = optax.softmax_cross_entropy(logits.astype(jnp.float32), onehot)  # [B]
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    count = jnp.sum(weights)
    return {"loss": (jnp.sum(ce * weights), count), "accuracy": (jnp.sum(correct * weights), count)}


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


def token_nll(logits, targets, weights=None):
    """``(sum of NLL, number of tokens)`` over ``targets [B, T]`` (0 = pad, not counted).

    `weights` ``[B]`` zeroes whole rows (eval padding).
    """
    logp = jax.nn.log_softmax(logits.astype(_f32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [B, T]
    w = (targets != 0).astype(_f32)
    if weights is not None:
        w = w * weights.astype(_f32)[:, None]
    return jnp.sum(nll * w), jnp.sum(w)


def perplexity(nll_sum, count) -> dict[str, float]:
    """``{"loss", "perplexity", "bits_per_byte"}`` from summed NLL (nats) and token count."""
    mean = float(nll_sum) / max(float(count), 1.0)
    return {
        "loss": mean,
        "perplexity": math.exp(min(mean, 50.0)),
        "bits_per_byte": mean / math.log(2),
    }


def lm_loss(logits, batch, weights, config=None):
    """The loop's loss terms: mean NLL per target byte, next-byte accuracy, bits per byte.

    ``logits [B, T, V]``, ``batch["targets"] [B, T]`` (0 = pad), `weights` ``[B]``.
    """
    del config
    targets = batch["targets"]
    total, count = token_nll(logits, targets, weights)
    w = (targets != 0).astype(_f32) * weights.astype(_f32)[:, None]
    correct = jnp.sum((jnp.argmax(logits, axis=-1) == targets).astype(_f32) * w)
    return {
        "loss": (total, count),
        "accuracy": (correct, count),
        "bits_per_byte": (total / math.log(2.0), count),
    }


def evaluate_perplexity(model, variables, data, split="val", batch_size=8, max_batches=None):
    """Perplexity of `model` on ``data[split]`` (a `train.data.text.TextData`; one ordered
    pass; deterministic)."""

    @jax.jit
    def nll(variables, batch):  # variables as an argument: see `init_cache`
        logits = model.apply(variables, batch["inputs"], deterministic=True)
        return token_nll(logits, batch["targets"], batch["mask"])

    total, count = 0.0, 0.0
    for batch in data.eval_batches(split, batch_size, max_batches=max_batches):
        s, c = nll(variables, {k: jnp.asarray(v) for k, v in batch.items()})
        total, count = total + float(s), count + float(c)
    return perplexity(total, count)


def lra_loss(outputs, batch, weights, config):
    """`classification_loss` with ``config.label_smoothing``."""
    return classification_loss(
        outputs, batch, weights, label_smoothing=float(config.label_smoothing)
    )


def vit_config_loss(outputs, batch, weights, config):
    """`vit_loss` with ``config.label_smoothing``."""
    return vit_loss(outputs, batch, weights, label_smoothing=float(config.label_smoothing))


__all__ = [
    "classification_loss",
    "evaluate_perplexity",
    "lm_loss",
    "lra_loss",
    "perplexity",
    "token_nll",
    "vit_config_loss",
    "vit_loss",
]
