"""Retrieval (LRA): AAN citation pairs, byte level, dual encoder, binary classification.

``full``: LRA's ``matching/configs/base_match_config.py``: batch 32, 5000 steps, Adam +
weight decay 0.1, rsqrt schedule with constant 0.05 and warmup 8000 (longer than the run:
the learning rate is still rising at the end, 0.05 * 5000 / 8000^1.5 = 4.4e-4, as in LRA),
seq_len 4000 per document, emb 128, 4 heads, 4 layers, qkv 128, mlp 512, CLS pooling,
dropout 0.1, sinusoidal positions; the head sees ``[u, v, u * v, u - v]``.
``mini``: AAN subset (2000 train pairs), seq_len 512, 2 layers, width 64, 300 steps.
"""

from __future__ import annotations

from train.configs import default


def get_config(preset: str = "full"):
    c = default.get_config()
    c.task = "retrieval"
    c.preset = preset
    c.data.num_threads = 4
    if preset == "mini":
        c.data.variant = "mini"
        c.update(num_train_steps=300, eval_every=100, checkpoint_every=100)
        return c
    if preset != "full":
        raise ValueError(f"retrieval presets: 'mini', 'full'; got {preset!r}")
    c.data.variant = "full"
    c.data.seq_len = 4000
    c.model.update(
        num_layers=4,
        emb_dim=128,
        num_heads=4,
        qkv_dim=128,
        mlp_dim=512,
        dropout_rate=0.1,
        pooling="cls",
        pos_emb="sinusoidal",
    )
    c.update(
        batch_size=32,
        num_train_steps=5000,
        schedule="rsqrt",
        warmup_steps=8000,
        learning_rate=0.05 / 8000**0.5,
        weight_decay=0.1,
        grad_clip_norm=None,
        eval_every=500,
        checkpoint_every=500,
        log_every=50,
        eval_batch_size=64,
    )
    return c
