"""Pathfinder (LRA ``pathfinder32``): are the two dots on the same contour? Binary.

``full``: LRA's ``image/configs/pathfinder32/transformer_base.py``: batch 512, 200 epochs
of 160000 images (312 steps each: 62400 steps), Adam with no weight decay, cosine decay
with peak 1e-3 and one epoch of warmup, 1 layer, 4 heads, emb 128, qkv 64, mlp 128,
dropout 0.2, **mean pooling**, sinusoidal positions (``learn_pos_emb=False``). No padding
mask (images). 1024 tokens (32x32). Data: our snakes generator at LRA's "hard" setting
(``data.difficulty``: ``easy`` / ``intermediate`` / ``hard`` = contour length 6 / 9 / 14),
or LRA's released images with ``data.source='lra'``.
``pathx``: the same model and schedule on 128x128 images (16384 tokens) drawn with
``train.configs.pathfinder_spec.PATHX``.
``mini``: ``train.configs.pathfinder_spec.MINI`` (12x12 images, 40000 train; main
contours of 3 paddles, no distractors: the easiest setting whose labels no cheap feature
predicts), an image stem (``model.conv_stem=1``: one 3x3 convolution on the pixel intensities,
``model.patch_size=2``: 36 tokens; `train.models.lra`), 2 layers, width 64, 4 heads, mean
pooling, 2000 steps of batch 64 with plain Adam (b2 0.999, eps 1e-8, no clipping). Not
LRA's model: over grey-level tokens nothing learned this task in a CPU budget (README).

Any field of the generator (``PathfinderSpec``: ``image_size``, ``contour_length``,
``num_distractors``, ...) can be set under ``data`` (``--set data.contour_length=9``).
"""

from __future__ import annotations

import dataclasses

import ml_collections

from train.configs import default
from train.configs.pathfinder_spec import FULL, PATHX, PathfinderSpec


def _spec_fields(c: ml_collections.ConfigDict) -> None:
    """``data.<field>`` = None (the variant's value) for every generator field."""
    kinds = {"int": int, "float": float}
    c.data.difficulty = "hard"
    for f in dataclasses.fields(PathfinderSpec):
        if f.name not in ("seed", "num_train", "num_val", "num_test"):
            c.data[f.name] = ml_collections.FieldReference(None, field_type=kinds[f.type])


def get_config(preset: str = "full"):
    c = default.get_config()
    c.task = "pathfinder"
    c.preset = preset
    c.model.pad_mask = False
    c.model.pooling = "mean"
    _spec_fields(c)
    if preset == "mini":
        c.data.variant = "mini"
        # over grey-level tokens no mechanism learns this in a CPU budget (README,
        # Pathfinder): a 3x3 conv stem and 2 x 2 patches (36 tokens of 4 x 4 pixels) make it
        # learnable while attention is still needed (without it: 55%; README), with plain
        # Adam (LRA's b2 = 0.98, eps = 1e-9 and clipping delay the take-off)
        c.model.update(conv_stem=1, patch_size=2)
        c.update(
            batch_size=64,
            num_train_steps=2000,
            warmup_steps=100,
            eval_every=250,
            b2=0.999,
            eps=1e-8,
            grad_clip_norm=None,
        )
        return c
    if preset not in ("full", "pathx"):
        raise ValueError(f"pathfinder presets: 'mini', 'full', 'pathx'; got {preset!r}")
    c.data.variant = "full"
    if preset == "pathx":
        for f in dataclasses.fields(PATHX):
            if getattr(PATHX, f.name) != getattr(FULL, f.name):
                c.data[f.name] = getattr(PATHX, f.name)
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
