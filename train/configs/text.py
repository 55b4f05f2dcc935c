"""Text (LRA): byte-level IMDB sentiment, binary classification.

``full``: LRA's ``text_classification/configs/base_tc_config.py``: batch 32, 20000 steps,
Adam + weight decay 0.1, rsqrt schedule with constant 0.05 and warmup 8000 (peak
0.05 / sqrt(8000) = 5.6e-4), emb 256, 4 heads, 4 layers, qkv 256, mlp 1024, CLS pooling,
dropout 0.1, sinusoidal positions, seq_len 4000 (the paper's "4K" setting: LRA's byte
IMDB runs use ``max_length`` 4000; the data default). Byte ids + 1, ``vocab_size`` 257.
``full_1k``: the same with seq_len 1000 (the released config file's ``max_length``).
``mini``: IMDB subset (4000 train), seq_len 512, 2 layers, width 64, 300 steps.
"""

from __future__ import annotations

from train.configs import default


def get_config(preset: str = "full"):
    c = default.get_config()
    c.task = "text"
    c.preset = preset
    c.data.num_threads = 4  # lazily tokenised source
    if preset == "mini":
        c.data.variant = "mini"
        c.update(num_train_steps=300, eval_every=100, checkpoint_every=100)
        return c
    if preset not in ("full", "full_1k"):
        raise ValueError(f"text presets: 'mini', 'full', 'full_1k'; got {preset!r}")
    c.data.variant = "full"
    c.data.seq_len = 1000 if preset == "full_1k" else 4000
    c.model.update(
        num_layers=4,
        emb_dim=256,
        num_heads=4,
        qkv_dim=256,
        mlp_dim=1024,
        dropout_rate=0.1,
        pooling="cls",
        pos_emb="sinusoidal",
    )
    c.update(
        batch_size=32,
        num_train_steps=20000,
        schedule="rsqrt",
        warmup_steps=8000,
        learning_rate=0.05 / 8000**0.5,
        weight_decay=0.1,
        grad_clip_norm=None,
        eval_every=1000,
        checkpoint_every=1000,
        log_every=100,
        eval_batch_size=64,
    )
    return c
