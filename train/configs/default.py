"""Base training config: every field the loop reads, with its meaning.

Task modules (``train/configs/<task>.py``) start from this and set the LRA values
(``get_config("full")``) or a CPU-sized ``mini`` preset (``get_config("mini")``).
Override any field from the command line: ``python -m train --set model.num_layers=2``
or ``--config.model.num_layers=2``.
"""

from __future__ import annotations

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    """The default config (ListOps mini sizes; see ``listops.py`` for the LRA values)."""
    c = ml_collections.ConfigDict()

    # --- what to train
    c.task = "listops"  # workload name in train.workloads.WORKLOADS (LRA task or a later one)
    c.preset = "mini"  # "mini" (CPU-sized) or "full" (LRA paper settings); informational
    c.attention = "flexformer_n"  # registry name of the attention mechanism (la.names())
    c.attention_config = (
        ml_collections.ConfigDict()
    )  # config bound to the mechanism, e.g. num_features

    # --- data (keys read by train.data.get_task; see its docstring)
    c.data = ml_collections.ConfigDict()
    c.data.variant = "mini"  # train.data variant: "mini" or "full"
    c.data.data_dir = ml_collections.FieldReference(
        None, field_type=str
    )  # None: $LINATTN_DATA_DIR or ~/.cache/linattn_jax/data
    c.data.seq_len = ml_collections.FieldReference(
        None, field_type=int
    )  # None: the task/variant default
    c.data.data_seed = 0  # seed of the ListOps / Pathfinder generators
    c.data.source = "generated"  # listops/pathfinder: "generated" or "lra" (released files)
    c.data.lra_dir = ml_collections.FieldReference(
        None, field_type=str
    )  # extracted lra_release/ folder
    c.data.tfds_data_dir = ml_collections.FieldReference(
        None, field_type=str
    )  # tfds dir for text/image
    c.data.num_train = ml_collections.FieldReference(
        None, field_type=int
    )  # None: variant default split size
    c.data.num_val = ml_collections.FieldReference(None, field_type=int)  # None: variant default
    c.data.num_test = ml_collections.FieldReference(None, field_type=int)  # None: variant default
    c.data.num_threads = 0  # grain read threads (>0 helps lazily decoded sources: text, image)

    # --- model (train.models)
    c.model = ml_collections.ConfigDict()
    c.model.num_layers = 2  # encoder blocks
    c.model.emb_dim = 64  # token embedding / residual width
    c.model.num_heads = 4  # attention heads
    c.model.qkv_dim = 64  # total q/k/v width (num_heads * head_dim)
    c.model.mlp_dim = 128  # hidden width of the block MLP and of the classifier head
    c.model.dropout_rate = 0.0  # dropout after embeddings, attention and MLP (0 = off)
    c.model.pooling = "cls"  # "cls" (learned CLS token prepended), "mean" (masked mean), "first"
    c.model.pos_emb = "learned"  # "learned" (N(0, 0.02)) or "sinusoidal" (fixed)
    c.model.pad_mask = True  # token id 0 is padding -> key-padding mask (False for images)
    c.model.tied_layers = False  # one block applied num_layers times (LRA ListOps "tied_weights")
    c.model.conv_stem = (
        0  # image stem: 3x3 conv layers on the pixel grid before attention (0 = off)
    )
    c.model.patch_size = 1  # image stem: square patches per token (1 = one token per pixel)
    c.model.dtype = "float32"  # computation dtype: "bfloat16" = mixed precision (params float32)

    # --- optimisation (optax adamw, LRA's Adam: b2 0.98, eps 1e-9, decoupled weight decay)
    c.batch_size = 32  # global batch size (split over every device of the mesh)
    c.num_train_steps = 500  # total optimizer steps
    c.learning_rate = 1e-3  # peak learning rate (after warmup)
    c.schedule = "cosine"  # "rsqrt" (LRA: warmup then lr*sqrt(warmup/step)), "cosine", "constant"
    c.warmup_steps = 50  # linear warmup from 0 to learning_rate
    c.end_lr_fraction = 0.0  # cosine: final lr as a fraction of the peak
    c.weight_decay = 0.0  # decoupled (adamw) decay of kernels / embeddings (ndim >= 2, no biases)
    # attention-mechanism params (path component "mechanism": flexformer frequencies and
    # temperature, rfa sigma, hedgehog, laplacian, lara proposals): their own lr and decay
    c.mechanism_lr_mult = 1.0  # their learning rate = learning_rate * this (same schedule)
    c.mechanism_weight_decay = 0.0  # their decoupled weight decay (every leaf; 0 = none)
    c.no_decay_params = ()  # param names never decayed, e.g. ("pos_embed", "cls") as in DeiT
    c.b1 = 0.9  # Adam beta1
    c.b2 = 0.98  # Adam beta2 (LRA)
    c.eps = 1e-9  # Adam epsilon (LRA)
    c.grad_clip_norm = 1.0  # global-norm clipping; 0 or None disables
    c.ema_decay = 0.0  # > 0: keep an EMA of the params (in the optimizer state) and evaluate it
    c.label_smoothing = 0.0  # classification cross-entropy label smoothing

    # --- evaluation, logging, checkpoints
    c.eval_every = 100  # evaluate on the val split every this many steps (and at the end)
    c.num_eval_batches = -1  # batches per eval (-1: the whole split)
    c.eval_batch_size = 64  # global eval batch size
    c.best_metric = "accuracy"  # eval metric that ranks the best checkpoint (workdir/best)
    c.best_mode = "max"  # "max" or "min" for best_metric
    c.eval_test = True  # also evaluate the test split at the end
    c.log_every = 10  # write train metrics (averaged over the window) every this many steps
    c.checkpoint_every = 100  # save a checkpoint every this many steps (and at the end)
    c.max_to_keep = 3  # latest checkpoints kept (the best one is kept separately)
    c.async_checkpointing = True  # orbax async saves (training continues while writing)
    c.progress_bar = True  # tqdm progress bar on process 0
    c.tensorboard = True  # write TensorBoard event files (tensorboardX) under workdir/tb
    c.plot = True  # write workdir/curves.png at the end (matplotlib Agg)
    c.compile_memory_analysis = True  # AOT-compile the train step and log its memory analysis

    # --- randomness
    c.seed = 0  # model init and per-step rng: fold_in(key(seed), step)
    # > 0: redraw the fixed random features (performer's and rfa's `fixed` collection) every
    # this many steps, from a key of (seed, step), so a resumed run redraws the same; 0: keep
    # the init draw for the whole run (docs/random_features.md)
    c.redraw_every = 0
    c.data_shuffle_seed = 0  # training stream shuffle seed (stream = f(seed, batch, step))

    # --- sharding (jax.sharding.Mesh over all devices; no pmap)
    # devices per mesh axis; one -1 takes the remaining devices; a shape without -1 takes
    # the first prod(shape) devices (one process; (1, 1): train on one device)
    c.mesh_shape = (-1, 1)
    c.mesh_axes = ("data", "fsdp")  # mesh axis names: batch over both, params over "fsdp"
    # a "seq" axis splits the tokens, attention sequence-parallel (LM, LRA encoders), e.g.
    # --set 'mesh_axes=("data","seq")' --set 'mesh_shape=(2,4)'; T must divide by its size
    c.data_axes = ("data", "fsdp")  # mesh axes the batch dimension is split over
    # logical axis name -> mesh axis (or None = replicated); parameters carry logical names
    # (embed, heads, kv, mlp, vocab, classes) via nn.with_logical_partitioning.
    c.logical_axis_rules = (
        ("embed", "fsdp"),
        ("mlp", None),
        ("heads", None),
        ("kv", None),
        ("vocab", None),
        ("classes", None),
        ("length", None),
    )
    c.distributed = False  # call jax.distributed.initialize() (multi-host launch)
    # jax.distributed.initialize arguments; None: detected from the cluster (SLURM, Open MPI,
    # Cloud TPU, ...; $JAX_COORDINATOR_ADDRESS for the address)
    c.coordinator_address = ml_collections.FieldReference(None, field_type=str)  # "host:port"
    c.num_processes = ml_collections.FieldReference(None, field_type=int)
    c.process_id = ml_collections.FieldReference(None, field_type=int)
    return c
