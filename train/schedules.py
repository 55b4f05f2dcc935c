"""Learning-rate schedules of a training config (a leaf module: `train.trainer` builds the
optimizer from it, `train.guard` compares two configs' schedules)."""

from __future__ import annotations

import jax.numpy as jnp
import optax


def learning_rate_schedule(config) -> optax.Schedule:
    """Linear warmup to ``learning_rate`` then ``rsqrt`` (LRA), ``cosine`` or ``constant``.

    rsqrt: ``lr * min(1, s / w) * sqrt(w / max(s, w))`` (LRA's ``linear_warmup *
    rsqrt_decay`` with its constant folded into the peak).
    """
    peak = float(config.learning_rate)
    warmup = int(config.warmup_steps)
    total = int(config.num_train_steps)
    kind = config.schedule
    if kind == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0,
            peak,
            warmup_steps=warmup,
            decay_steps=max(total, warmup + 1),
            end_value=peak * float(config.end_lr_fraction),
        )
    if kind not in ("rsqrt", "constant"):
        raise ValueError(f"schedule must be 'rsqrt', 'cosine' or 'constant', got {kind!r}")

    def schedule(step):
        s = jnp.asarray(step, jnp.float32)
        ramp = jnp.minimum(1.0, s / warmup) if warmup > 0 else 1.0
        if kind == "constant" or warmup == 0:
            return peak * ramp
        return peak * ramp * jnp.sqrt(warmup / jnp.maximum(s, warmup))

    return schedule


__all__ = ["learning_rate_schedule"]
