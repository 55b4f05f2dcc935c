"""Image (LRA): grayscale CIFAR-10 as a sequence of 1024 pixel tokens, 10 classes.

``full``: LRA's ``image/configs/cifar10/base_cifar10_config.py`` (transformer_base):
batch 256, 200 epochs of 45000 images (175 steps each: 35000 steps), Adam with no weight
decay, ``constant * linear_warmup * cosine_decay`` with peak 5e-4 and one epoch (175
steps) of warmup, 1 layer, 1 head, emb 32, qkv 32, mlp 64, dropout 0.3 (LRA's attention
dropout 0.2 is not applied: our mechanisms have no attention-weight dropout), CLS
pooling, learned positions. No padding mask (pixel 0 is black, not padding).
``mini``: 16x16 (2x2 average-pooled) images, 256 tokens, 4000 train images, 1 layer,
width 64, 4 heads, 300 steps.
"""

from __future__ import annotations

from train.configs import default


def get_config(preset: str = "full"):
    c = default.get_config()
    c.task = "image"
    c.preset = preset
    c.model.pad_mask = False
    c.model.pos_emb = "learned"
    c.data.num_threads = 4
    if preset == "mini":
        c.data.variant = "mini"
        c.model.num_layers = 1
        c.update(num_train_steps=300, eval_every=100, checkpoint_every=100)
        return c
    if preset != "full":
        raise ValueError(f"image presets: 'mini', 'full'; got {preset!r}")
    c.data.variant = "full"
    c.model.update(
        num_layers=1,
        emb_dim=32,
        num_heads=1,
        qkv_dim=32,
        mlp_dim=64,
        dropout_rate=0.3,
        pooling="cls",
    )
    steps_per_epoch = 45_000 // 256
    c.update(
        batch_size=256,
        num_train_steps=200 * steps_per_epoch,
        schedule="cosine",
        warmup_steps=steps_per_epoch,
        learning_rate=5e-4,
        weight_decay=0.0,
        grad_clip_norm=None,
        eval_every=steps_per_epoch,
        checkpoint_every=10 * steps_per_epoch,
        log_every=25,
        eval_batch_size=256,
    )
    return c
