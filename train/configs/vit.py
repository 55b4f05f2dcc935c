"""ViT / DeiT image classification (workload ``vit``, `train.vision`): ImageNet-1k or CIFAR-10.

Presets:

* ``deit_tiny``: DeiT-tiny on ImageNet-1k (tfds ``imagenet2012``, 224x224, patch 16, 196
  tokens + CLS), the DeiT recipe (Touvron et al. 2021): 300 epochs at batch 1024 (1251
  steps per epoch), AdamW (b1 0.9, b2 0.999, eps 1e-8, weight decay 0.05 on the kernels,
  not on biases, norms, the position embedding or the CLS token), peak lr
  ``5e-4 * 1024 / 512 = 1e-3``, 5 warmup epochs then cosine to 1e-5,
  label smoothing 0.1, stochastic depth 0.1, Mixup 0.8 / CutMix 1.0 (switch 0.5),
  random-resized crop + flip, RandAugment ``rand-m9-mstd0.5-inc1`` (2 ops, magnitude
  9, std 0.5), random erasing 0.25 (pixel mode); evaluation: resize 256 / centre crop
  224; bfloat16 compute (float32 params; DeiT trains with fp16 AMP). Width 192, 12
  blocks, 3 heads, MLP 768, parameter EMA 0.99996 (evaluated in place of the params).
  Not included: repeated augmentation.
  Sharding: data parallel over every device; ``mesh_shape=(-1, N)`` adds FSDP over N
  devices (``embed`` -> ``fsdp``).
* ``cifar``: ViT on CIFAR-10 at 32x32 (patch 4: 64 tokens + CLS), width 192, 9 blocks,
  3 heads, batch 128, 200 epochs, AdamW lr 1e-3, wd 0.05, label smoothing 0.1, pad-crop +
  flip, Mixup/CutMix off.
* ``mini``: a CPU-sized CIFAR-10 run: 4000 training images, width 64, 4 blocks, 4 heads,
  batch 64, 300 steps.

Mechanisms with a ``grid`` config (nystromformer, soft, laplacian, lara) get the patch grid
automatically (`train.models.vit.attention_config`); set ``attention_config.num_landmarks`` /
``num_features`` / ``num_samples`` as for any task.

LARA in every ViT preset (`attention_defaults`) uses the official code's image proposals
(Zheng et al. 2022, ``proposal_gen="pool"`` with the ``-mixed`` key landmarks):
``proposal="pool"`` (the patch grid average-pooled, then ``LayerNorm(Linear(.))`` per
head), ``mixed=True``, and ``num_landmarks=49`` (a 7 x 7 grid: 2 x 2 pooling of DeiT-tiny's
14 x 14 patches; the ``mini`` preset's 8 x 8 patches get 16 = 4 x 4, the same 2 x 2
pooling). The LRA tasks keep the library default (``proposal="mean"``, 1-D segment means,
no params); ``"adaptive-1d"`` is the official learned 1-D form.
"""

from __future__ import annotations

import ml_collections

from train.configs import default

#: LARA's settings in the ViT presets (see the module docstring).
LARA_VIT = {"proposal": "pool", "mixed": True, "num_landmarks": 49}


def attention_defaults(preset: str, attention: str) -> dict:
    """Per-mechanism config of the ViT presets (applied by `train.configs.set_attention`)."""
    if attention != "lara":
        return {}
    return {**LARA_VIT, "num_landmarks": 16} if preset == "mini" else dict(LARA_VIT)


def get_config(preset: str = "mini") -> ml_collections.ConfigDict:
    c = default.get_config()
    c.task = "vit"
    c.preset = preset
    c.attention = "softmax"
    c.data = ml_collections.ConfigDict()
    c.data.dataset = "cifar10"  # "imagenet2012" (manual download, built with tfds) or "cifar10"
    c.data.image_size = 32  # side of the (square) training / eval images
    c.data.augment = ml_collections.FieldReference(None, field_type=str)  # None: per data set
    c.data.crop_fraction = 0.875  # ImageNet eval: resize to size / fraction, centre-crop
    # RandAugment (num_ops, magnitude 0..10, magnitude_std) after the crop / flip; None = off
    c.data.randaugment = ml_collections.FieldReference(None, field_type=tuple)
    c.data.random_erasing = 0.0  # probability of erasing a box with pixel noise; 0 = off
    c.data.data_dir = ml_collections.FieldReference(None, field_type=str)  # generated caches
    c.data.tfds_data_dir = ml_collections.FieldReference(None, field_type=str)  # tfds data dir
    c.data.num_train = ml_collections.FieldReference(None, field_type=int)  # subset sizes
    c.data.num_val = ml_collections.FieldReference(None, field_type=int)
    c.data.num_test = ml_collections.FieldReference(None, field_type=int)
    c.data.num_threads = 4  # grain read threads (decoding + augmentation)

    c.model = ml_collections.ConfigDict()
    c.model.patch_size = 4  # p: tokens = (size / p)^2 + CLS
    c.model.emb_dim = 64  # width
    c.model.num_layers = 4  # blocks
    c.model.num_heads = 4  # heads
    c.model.qkv_dim = ml_collections.FieldReference(None, field_type=int)  # None: emb_dim
    c.model.mlp_dim = 128  # MLP hidden width
    c.model.dropout_rate = 0.0  # dropout on embeddings and residual branches
    c.model.drop_path_rate = 0.0  # stochastic depth (max, linear over blocks)
    c.model.pooling = "cls"  # "cls" or "mean"
    c.model.mixup_alpha = 0.0  # Mixup Beta(alpha, alpha); 0 = off
    c.model.cutmix_alpha = 0.0  # CutMix Beta(alpha, alpha); 0 = off
    c.model.mix_switch_prob = 0.5  # probability of CutMix when both are on
    c.model.dtype = "float32"  # computation dtype ("bfloat16": mixed precision, params float32)

    c.mesh_shape = (-1, 1)
    c.b2 = 0.999
    c.eps = 1e-8
    c.grad_clip_norm = ml_collections.FieldReference(None, field_type=float)
    c.label_smoothing = 0.1
    c.weight_decay = 0.05
    c.no_decay_params = ("pos_embed", "cls")  # DeiT / timm: no decay on position / CLS tokens
    c.schedule = "cosine"

    if preset == "mini":
        c.data.num_train = 4000
        c.data.num_val = 500
        c.data.num_test = 500
        c.label_smoothing = 0.0
        c.weight_decay = 0.0
        c.update(
            batch_size=64,
            num_train_steps=300,
            learning_rate=1e-3,
            warmup_steps=30,
            eval_every=100,
            checkpoint_every=100,
            log_every=10,
            eval_batch_size=100,
        )
        return c
    if preset == "cifar":
        c.model.update(emb_dim=192, num_layers=9, num_heads=3, mlp_dim=384, drop_path_rate=0.1)
        steps_per_epoch = 45_000 // 128
        c.update(
            batch_size=128,
            num_train_steps=200 * steps_per_epoch,
            learning_rate=1e-3,
            warmup_steps=5 * steps_per_epoch,
            end_lr_fraction=0.01,
            eval_every=steps_per_epoch,
            checkpoint_every=5 * steps_per_epoch,
            log_every=50,
            eval_batch_size=500,
        )
        return c
    if preset != "deit_tiny":
        raise ValueError(f"vit presets: 'mini', 'cifar', 'deit_tiny'; got {preset!r}")
    c.data.dataset = "imagenet2012"
    c.data.image_size = 224
    c.data.randaugment = (2, 9, 0.5)  # timm rand-m9-mstd0.5-inc1
    c.data.random_erasing = 0.25
    c.ema_decay = 0.99996  # DeiT's model EMA
    c.model.update(
        patch_size=16,
        emb_dim=192,
        num_layers=12,
        num_heads=3,
        mlp_dim=768,
        drop_path_rate=0.1,
        mixup_alpha=0.8,
        cutmix_alpha=1.0,
        dtype="bfloat16",
    )
    batch = 1024
    steps_per_epoch = 1_281_167 // batch
    c.update(
        batch_size=batch,
        num_train_steps=300 * steps_per_epoch,
        learning_rate=5e-4 * batch / 512,
        warmup_steps=5 * steps_per_epoch,
        end_lr_fraction=1e-5 / (5e-4 * batch / 512),
        eval_every=steps_per_epoch,
        checkpoint_every=steps_per_epoch,
        log_every=100,
        eval_batch_size=1000,
        num_eval_batches=-1,
        async_checkpointing=True,
    )
    c.data.num_threads = 16
    return c
