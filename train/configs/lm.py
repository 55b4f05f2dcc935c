"""Causal language modelling (workload ``lm``, `train.lm`): byte-level, any text file.

Presets:

* ``mini``: the CPU preset: the Python standard library's sources as the corpus
  (``data.path="stdlib"``, first 4 MB, split 90/5/5; offline), context 128 bytes, 2 layers,
  width 128, 4 heads, batch 32, 500 steps.
* ``wikitext103``: WikiText-103 raw at the byte level (``data.path`` = the folder holding
  ``wiki.train.raw``, ``wiki.valid.raw``, ``wiki.test.raw``), the "small" size of the
  Flexformer paper's LM study (~40M parameters: 12 layers, width 512, 8 heads, MLP 2048),
  context 512, batch 64, 100k steps, AdamW (b2 0.95) lr 6e-4 with 2000 warmup steps and
  cosine decay, weight decay 0.1, dropout 0.1, bfloat16 compute (float32 params).

Only causal mechanisms (``la.causal_names()``) apply. The best checkpoint is the lowest
validation loss (mean NLL per byte; perplexity = exp(loss)).
"""

from __future__ import annotations

import ml_collections

from train.configs import default


def get_config(preset: str = "mini") -> ml_collections.ConfigDict:
    c = default.get_config()
    c.task = "lm"
    c.preset = preset
    c.attention = "flexformer_n"
    c.data = ml_collections.ConfigDict()
    c.data.path = "stdlib"  # a text file, a WikiText-style folder of *.raw files, or "stdlib"
    c.data.max_bytes = 4_000_000  # "stdlib" only: corpus size in bytes
    c.data.val_fraction = 0.05  # single file: val and test fraction each
    c.data.seq_len = 128  # context length T (training windows hold T + 1 bytes)
    c.data.num_threads = 0  # unused (slicing a byte array)

    c.model = ml_collections.ConfigDict()
    c.model.num_layers = 2  # decoder blocks
    c.model.emb_dim = 128  # width
    c.model.num_heads = 4  # heads
    c.model.qkv_dim = 128  # total q/k/v width
    c.model.mlp_dim = 512  # MLP hidden width
    c.model.dropout_rate = 0.0  # dropout on embeddings and residual branches
    c.model.tie_embeddings = True  # output layer = embedding^T
    c.model.dtype = "float32"  # computation dtype ("bfloat16": mixed precision)

    c.best_metric = "loss"  # rank checkpoints by validation NLL ...
    c.best_mode = "min"  # ... lower is better
    c.label_smoothing = 0.0
    c.b2 = 0.98
    c.eps = 1e-9
    if preset == "mini":
        c.update(
            batch_size=32,
            num_train_steps=500,
            learning_rate=2e-3,
            warmup_steps=50,
            eval_every=100,
            checkpoint_every=100,
            log_every=10,
            eval_batch_size=32,
            num_eval_batches=20,
        )
        return c
    if preset != "wikitext103":
        raise ValueError(f"lm presets: 'mini', 'wikitext103'; got {preset!r}")
    c.data.path = "~/.cache/linattn_jax/data/wikitext-103-raw"
    c.data.seq_len = 512
    c.model.update(
        num_layers=12,
        emb_dim=512,
        num_heads=8,
        qkv_dim=512,
        mlp_dim=2048,
        dropout_rate=0.1,
        dtype="bfloat16",
    )
    c.update(
        batch_size=64,
        num_train_steps=100_000,
        learning_rate=6e-4,
        warmup_steps=2000,
        end_lr_fraction=0.1,
        weight_decay=0.1,
        b2=0.95,
        eps=1e-8,
        grad_clip_norm=1.0,
        eval_every=2000,
        checkpoint_every=2000,
        log_every=100,
        eval_batch_size=64,
        num_eval_batches=200,
    )
    return c
