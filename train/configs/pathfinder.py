"""Pathfinder (LRA ``pathfinder32``): are the two dots connected by a path? Binary.

``full``: LRA's ``image/configs/pathfinder32/transformer_base.py``: batch 512, 200 epochs
of 160000 images (312 steps each: 62400 steps), Adam with no weight decay, cosine decay
with peak 1e-3 and one epoch of warmup, 1 layer, 4 heads, emb 128, qkv 64, mlp 128,
dropout 0.2, **mean pooling**, sinusoidal positions (``learn_pos_emb=False``). No padding
mask (images). 1024 tokens (32x32).
``mini``: generated 16x16 images (256 tokens, 4000 train), 2 layers, width 64, 4 heads,
mean pooling, 500 steps.
"""

from __future__ import annotations

from train.configs import default


def get_config(preset: str = "full"):
    c = default.get_config()
    c.task = "pathfinder"
    c.preset = preset
    c.model.pad_mask = False
    c.model.pooling = "mean"
    if preset == "mini":
        c.data.variant = "mini"
        return c
    if preset != "full":
        raise ValueError(f"pathfinder presets: 'mini', 'full'; got {preset!r}")
    c.data.variant = "full"
    c.model.update(
        num_layers=1,
        emb_dim=128,
        num_heads=4,
        qkv_dim=64,
        mlp_dim=128,
        dropout_rate=0.2,
        pos_emb="sinusoidal",
    )
    steps_per_epoch = 160_000 // 512
    c.update(
        batch_size=512,
        num_train_steps=200 * steps_per_epoch,
        schedule="cosine",
        warmup_steps=steps_per_epoch,
        learning_rate=1e-3,
        weight_decay=0.0,
        grad_clip_norm=None,
        eval_every=steps_per_epoch,
        checkpoint_every=10 * steps_per_epoch,
        log_every=25,
        eval_batch_size=512,
    )
    return c
