"""ListOps (LRA): 10-way classification of nested MIN/MAX/MED/SM expressions.

``full``: LRA's released ``listops/configs/base_listops_config.py`` (transformer_base):
batch 32, 5000 steps, Adam (b2 0.98, eps 1e-9, decoupled weight decay 0.1), LRA's
``constant * linear_warmup * rsqrt_decay`` schedule with constant 0.05 and warmup 1000
(so a peak of 0.05 / sqrt(1000) = 1.58e-3 at step 1000, then ``peak * sqrt(1000 / step)``),
seq_len 2000, emb 512, 8 heads, qkv 512, mlp 2048, **6 layers with tied weights**
(``tied_weights = True``), CLS pooling, dropout 0.1, sinusoidal positions (LRA's encoder
default ``learn_pos_emb=False``). The LRA paper's text quotes smaller models for some
baselines; we follow the released config file.

``mini``: the CPU preset: generated ListOps mini (lengths 20-100, seq_len 128, 5000 train
examples), 2 layers, width 64, 4 heads, 500 steps with cosine decay; a few minutes on 2 cores.
"""

from __future__ import annotations

from train.configs import default


def get_config(preset: str = "full"):
    c = default.get_config()
    c.task = "listops"
    c.preset = preset
    if preset == "mini":
        c.data.variant = "mini"
        return c
    if preset != "full":
        raise ValueError(f"listops presets: 'mini', 'full'; got {preset!r}")
    c.data.variant = "full"
    c.data.seq_len = 2000
    c.model.update(
        num_layers=6,
        emb_dim=512,
        num_heads=8,
        qkv_dim=512,
        mlp_dim=2048,
        dropout_rate=0.1,
        pooling="cls",
        pos_emb="sinusoidal",
        tied_layers=True,
    )
    c.update(
        batch_size=32,
        num_train_steps=5000,
        schedule="rsqrt",
        warmup_steps=1000,
        learning_rate=0.05 / 1000**0.5,
        weight_decay=0.1,
        grad_clip_norm=None,
        eval_every=500,
        checkpoint_every=500,
        log_every=50,
        eval_batch_size=64,
    )
    return c
