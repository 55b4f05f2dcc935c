"""Training stack: sharded step == single-device step, schedules, configs, models, checkpoints."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import max_rel_err
from jax.sharding import PartitionSpec

from train import checkpoint as ckpt_lib
from train import configs, models
from train import trainer as trainer_lib
from train.data.pipeline import ArraySource, Task
from train.schedules import learning_rate_schedule
from train.trainer import Trainer

SEQ = 32


def toy_task(n=64, seq_len=SEQ, vocab=12, classes=3, pair=False, seed=0):
    """Random tokens with trailing padding; label = (count of token 1) mod classes."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(seq_len // 2, seq_len + 1, size=n)
    pad = np.arange(seq_len)[None, :] < lengths[:, None]

    def tokens():
        return (rng.integers(1, vocab, size=(n, seq_len)) * pad).astype(np.int32)

    arrays = {"inputs1": tokens(), "inputs2": tokens()} if pair else {"inputs": tokens()}
    first = arrays["inputs1" if pair else "inputs"]
    arrays["targets"] = ((first == 1).sum(1) % classes).astype(np.int32)
    split = ArraySource(arrays)
    return Task(
        name="toy",
        splits={"train": split, "val": split, "test": split},
        vocab_size=vocab,
        num_classes=classes,
        seq_len=seq_len,
        is_pair=pair,
        batch_size=16,
    )


def tiny_config(attention="performer", **attention_config):
    c = configs.get_config("listops", "mini")
    configs.set_attention(c, attention)
    c.attention_config.update(attention_config)
    c.model.update(num_layers=2, emb_dim=16, num_heads=2, qkv_dim=16, mlp_dim=32)
    c.update(batch_size=16, eval_batch_size=16, warmup_steps=1, num_train_steps=10)
    c.learning_rate = 3e-3
    return c


def _run_steps(config, task, devices, n=2, *, keep_init=False):
    trainer = Trainer(config, task, devices=devices)
    state = trainer.init_state()
    init = jax.device_get(state) if keep_init else None
    keys = (*trainer.input_keys, "targets")
    losses = []
    for step in range(n):
        batch = trainer.to_global(task.train_batch(step, config.batch_size, seed=0), keys)
        state, m = trainer.train_step(state, batch)
        losses.append(float(m["loss"]))
    if keep_init:
        return trainer, jax.device_get(state), losses, init
    return trainer, jax.device_get(state), losses


# Float32 sums are reduced in a different order once the batch / embed axes are split, so
# sharded and single-device results agree to rounding, not bitwise: rtol 1e-5, atol 1e-6
# on the loss of both steps and on every parameter and Adam moment after 2 steps.
def test_sharded_step_matches_single_device():
    assert jax.device_count() >= 8, "conftest fakes 8 CPU devices"
    task = toy_task()
    # performer: fixed random features ("fixed" collection) and per-step sampling ("attention")
    config = tiny_config("performer", num_features=8, redraw="call")
    single = config.copy_and_resolve_references()
    single.mesh_shape = (1, 1)
    _, want_state, want_losses, init = _run_steps(single, task, jax.devices()[:1], keep_init=True)
    assert want_losses[1] != want_losses[0]  # the params did move
    # fixed features are carried in the state but not optimised; the params are
    jax.tree.map(np.testing.assert_array_equal, want_state.extra, init.extra)
    assert "fixed" in want_state.extra
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), want_state.params, init.params)
    assert min(jax.tree.leaves(moved)) > 0
    for mesh_shape in [(4, 2)]:  # data and fsdp both split; (8, 1): test_flexformer's meshes
        config.mesh_shape = mesh_shape
        trainer, got_state, got_losses = _run_steps(config, task, jax.devices()[:8])
        assert dict(trainer.mesh.shape) == {"data": mesh_shape[0], "fsdp": mesh_shape[1]}
        np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5, atol=1e-6)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
            got_state.as_dict(),
            want_state.as_dict(),
        )
        # embed-axis params are split over fsdp (a no-op split when it has 1 device)
        emb = trainer.state_shardings.params["encoder"]["embed"]["embedding"]
        assert emb.spec == PartitionSpec(None, "fsdp")
        assert emb.shard_shape((12, 16)) == (12, 16 // mesh_shape[1])


def test_rsqrt_schedule_is_lra():
    c = tiny_config()
    c.update(schedule="rsqrt", warmup_steps=1000, learning_rate=0.05 / 1000**0.5)
    s = learning_rate_schedule(c)
    for step in (0, 10, 500, 1000, 4000):
        # LRA: 0.05 * min(1, step / warmup) / sqrt(max(step, warmup))
        want = 0.05 * min(1.0, step / 1000) / max(step, 1000) ** 0.5
        np.testing.assert_allclose(float(s(step)), want, rtol=1e-6)
    c.update(schedule="cosine", warmup_steps=10, num_train_steps=110, learning_rate=1.0)
    s = learning_rate_schedule(c)
    np.testing.assert_allclose(
        [float(s(5)), float(s(10)), float(s(60)), float(s(110))], [0.5, 1.0, 0.5, 0.0], atol=1e-6
    )


def test_config_overrides():
    c = configs.get_config("listops", "mini")
    assert c.attention == "flexformer_n" and c.attention_config.num_features == 32
    configs.apply_overrides(
        c,
        [
            "model.num_layers=3",
            "learning_rate=1",
            "mesh_shape=(4, 2)",
            "data.seq_len=64",
            "attention_config.num_features=8",
            "grad_clip_norm=None",
            "attention=softmax",
        ],
    )
    assert c.model.num_layers == 3 and c.learning_rate == 1.0 and isinstance(c.learning_rate, float)
    assert c.mesh_shape == (4, 2) and c.data.seq_len == 64 and c.grad_clip_norm is None
    assert c.attention_config.num_features == 8 and c.attention == "softmax"
    with pytest.raises(ValueError, match="unknown config key"):
        configs.apply_overrides(c, ["model.num_layer=3"])
    with pytest.raises(ValueError, match="key=value"):
        configs.apply_overrides(c, ["model.num_layers"])
    with pytest.raises(ValueError, match="num_layers"):
        configs.apply_overrides(c, ["model.num_layers=abc"])
    full = configs.get_config("listops", "full")
    assert (full.model.num_layers, full.model.emb_dim, full.model.num_heads) == (6, 512, 8)
    assert full.data.seq_len == 2000 and full.num_train_steps == 5000
    assert len(full.attention_config) == 0  # no mini shortcuts for the full settings
    for task in ("listops", "text", "retrieval", "image", "pathfinder"):
        for preset in ("mini", "full"):
            assert configs.get_config(task, preset).task == task


# ----------------------------------------------------------------------------- models
def _encoder(pooling, **kw):
    return models.Encoder(
        vocab_size=12,
        max_len=SEQ,
        num_layers=1,
        emb_dim=16,
        num_heads=2,
        qkv_dim=16,
        mlp_dim=32,
        attention="softmax",
        pooling=pooling,
        **kw,
    )


def test_image_stem_tokens_and_errors():
    """The image stem (mini Pathfinder) turns an S x S image of pixel ids into (S/p)^2
    tokens; a token sees only its patch plus conv_stem pixels around it (a pixel far from a
    patch leaves that patch's token unchanged), and bad grids / settings raise."""
    from flax import traverse_util
    from flax.core import meta

    kw = dict(vocab_size=256, num_layers=0, emb_dim=8, num_heads=2, qkv_dim=8, mlp_dim=8)
    enc = models.Encoder(
        max_len=64, conv_stem=1, patch_size=2, pooling="first", pad_mask=False, **kw
    )
    img = jax.random.randint(jax.random.key(0), (2, 64), 0, 256)
    params = enc.init(jax.random.key(1), img, deterministic=True)
    flat = traverse_util.flatten_dict(meta.unbox(params["params"]))
    assert {"/".join(k) for k in flat} == {
        "pixel_embed/kernel",
        "pixel_embed/bias",
        "stem_0/kernel",
        "stem_0/bias",
        "patches/kernel",
        "patches/bias",
        "ln_final/scale",
        "ln_final/bias",
        "pos_embed",
    }
    assert flat[("pos_embed",)].shape == (16, 8)  # (8 / 2)^2 tokens, no CLS

    def tokens(x):  # the stem's tokens, before positions: pooling "first" reads token 0
        return enc.apply(params, x, deterministic=True)

    far = img.at[:, 7 * 8 + 7].set(0)  # bottom-right pixel: outside token 0's reach
    np.testing.assert_array_equal(tokens(img), tokens(far))
    near = img.at[:, 2 * 8 + 2].set((img[:, 2 * 8 + 2] + 128) % 256)  # 3x3 conv reaches (1,1)
    assert not np.allclose(tokens(img), tokens(near))
    bad = [
        (dict(max_len=60, conv_stem=1, pad_mask=False), (1, 60), "square grid"),
        (dict(max_len=49, patch_size=2, pad_mask=False), (1, 49), "square grid"),
        (dict(max_len=64, conv_stem=1, pad_mask=True), (1, 64), "pad_mask=False"),
        (dict(max_len=64, conv_stem=-1, pad_mask=False), (1, 64), "conv_stem >= 0"),
    ]
    for fields, shape, match in bad:
        with pytest.raises(ValueError, match=match):
            models.Encoder(**kw, **fields).init(
                jax.random.key(0), jnp.ones(shape, jnp.int32), deterministic=True
            )


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_padding_is_ignored(pooling):
    """Changing what sits under pad positions can't change the output: the pad mask is
    built from token 0 and every layer ignores masked keys. Here we compare two inputs that
    differ only in how much trailing padding there is (the model sees T=SEQ either way)."""
    enc = _encoder(pooling)
    tokens = np.zeros((2, SEQ), np.int32)
    tokens[:, :10] = np.random.default_rng(0).integers(1, 12, size=(2, 10))
    variables = enc.init(jax.random.key(0), tokens, deterministic=True)
    apply = jax.jit(lambda v, t: enc.apply(v, t, deterministic=True))
    out = apply(variables, tokens)
    # The same 10 tokens with the tail now filled by *different* padding lengths is not
    # expressible (pad is always 0), so compare against a model on the 10-token prefix.
    # Positions are absolute, so the prefix model sees exactly the same non-pad inputs.
    out_prefix = apply(variables, tokens[:, :10])
    np.testing.assert_allclose(out, out_prefix, rtol=1e-5, atol=1e-5)
    # ... while without the pad mask the padding changes the result
    enc_nomask = _encoder(pooling, pad_mask=False)
    apply = jax.jit(lambda v, t: enc_nomask.apply(v, t, deterministic=True))
    a, b = apply(variables, tokens), apply(variables, tokens[:, :10])
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-3


def test_dual_encoder_shares_encoder_and_checks_shapes():
    enc = _encoder("cls")
    model = models.DualEncoderClassifier(encoder=enc, num_classes=2)
    t1 = np.random.default_rng(1).integers(1, 12, size=(3, SEQ)).astype(np.int32)
    t2 = np.random.default_rng(2).integers(1, 12, size=(3, SEQ)).astype(np.int32)
    variables = jax.jit(model.init)(jax.random.key(0), t1, t2)
    assert set(variables["params"]) == {"encoder", "head"}
    logits = jax.jit(model.apply)(variables, t1, t2)
    assert logits.shape == (3, 2)
    # the head sees [u, v, u*v, u-v] of the shared encoder's outputs
    encode = jax.jit(lambda p, t: enc.apply({"params": p}, t, deterministic=True))
    u = encode(variables["params"]["encoder"], t1)
    v = encode(variables["params"]["encoder"], t2)
    feats = jnp.concatenate([u, v, u * v, u - v], axis=-1)
    want = models.ClassifierHead(2, 32).apply({"params": variables["params"]["head"]}, feats)
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="share a shape"):
        model.apply(variables, t1, t2[:, :8])


def test_tied_layers_share_params():
    enc = _encoder("cls", tied_layers=True).clone(num_layers=3)
    tokens = np.ones((1, SEQ), np.int32)
    params = jax.eval_shape(lambda: enc.init(jax.random.key(0), tokens, deterministic=True))
    params = params["params"]
    assert [k for k in params if k.startswith("block")] == ["block"]


# ----------------------------------------------------------------------------- checkpoints
def _tree(x):
    return {"w": np.full((4, 3), x, np.float32), "step": np.int32(x)}


def _corrupt(step_dir):
    files = [p for p in step_dir.rglob("*") if p.is_file()]
    assert files
    for p in files:
        p.write_bytes(b"\x00garbage")


def test_corrupt_latest_checkpoint_is_skipped(tmp_path):
    ck = ckpt_lib.Checkpointer(tmp_path, max_to_keep=5, async_save=True)
    for s in (1, 2, 3):
        ck.save(s, _tree(s), {"step": s})
    ck.wait()
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), _tree(0)
    )
    _corrupt(tmp_path / "checkpoints" / "3")
    with pytest.warns(RuntimeWarning, match="failed to restore"):
        state, meta = ck.restore_latest(target)
    assert meta["step"] == 2 and int(state["step"]) == 2
    np.testing.assert_array_equal(state["w"], _tree(2)["w"])
    assert not (tmp_path / "checkpoints" / "3").exists()  # moved aside, not deleted
    assert len(list((tmp_path / "checkpoints_corrupt").iterdir())) == 1
    # training can save step 3 again afterwards
    assert ck.save(3, _tree(3), {"step": 3})
    ck.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        state, meta = ck.restore_latest(target)
    assert meta["step"] == 3
    # a partial save (orbax temp dir of a killed writer) is not even listed
    (tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp-123").mkdir()
    ck.close()
    ck = ckpt_lib.Checkpointer(tmp_path, max_to_keep=5)
    assert ck.latest.latest_step() == 3
    ck.close()


@pytest.mark.parametrize("attention", ["softmax", "flexformer_n"])
def test_bfloat16_compute(attention):
    """``model.dtype = "bfloat16"``: float32 logits within bf16 rounding of the float32
    model's with the same params (two blocks and a head: 16 ulp = 6% of the logits' scale;
    measured 0.9% softmax, 2.4% flexformer_n); float16 (no loss scaling) is refused."""
    task = toy_task()
    c32, c16 = tiny_config(attention), tiny_config(attention)
    c16.model.dtype = "bfloat16"
    kw = dict(vocab_size=12, num_classes=3, seq_len=SEQ, is_pair=False)
    m32, m16 = models.build_classifier(c32, **kw), models.build_classifier(c16, **kw)
    assert m16.encoder.dtype == jnp.bfloat16 and m32.encoder.dtype == jnp.float32
    tokens = task.train_batch(0, 16, seed=0)["inputs"]
    variables = m32.init({"params": jax.random.key(0)}, tokens)
    want, got = m32.apply(variables, tokens), m16.apply(variables, tokens)
    assert got.dtype == jnp.float32
    err = max_rel_err(got, want)
    assert 1e-4 < err < 16 * 2.0**-8, err
    with pytest.raises(ValueError, match="model.dtype"):
        c16.model.dtype = "float16"
        models.build_classifier(c16, **kw)


def test_bfloat16_training_steps():
    """Train steps with bf16 compute: float32 params and Adam state, a first loss within
    bf16 rounding of the float32 run's (same init, same batch), finite losses after."""
    task = toy_task()
    c32, c16 = tiny_config("softmax"), tiny_config("softmax")
    c16.model.dtype = "bfloat16"
    _, _, l32 = _run_steps(c32, task, jax.devices()[:1], n=1)
    _, s16, l16 = _run_steps(c16, task, jax.devices()[:1], n=3)
    leaves = jax.tree.leaves((s16.params, s16.opt_state))
    assert {x.dtype for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)} == {
        jnp.dtype(jnp.float32)
    }
    assert np.all(np.isfinite(l16)) and 0 < abs(l16[0] - l32[0]) < 16 * 2.0**-8 * l32[0]


def test_param_ema_is_the_average_of_the_params_after_each_step(tmp_path):
    """`param_ema` against the recursion written out, and a Trainer that keeps one: sharded
    like the params, evaluated in their place, and the same as the recursion over the
    params the training steps produced."""
    tx = trainer_lib.param_ema(0.75)
    params = {"w": jnp.arange(3.0), "b": jnp.ones(())}
    state = tx.init(params)
    want = jax.tree.map(np.asarray, params)
    for i in range(3):
        updates = jax.tree.map(lambda p, i=i: jnp.full_like(p, 0.5 * (i + 1)), params)
        out, state = tx.update(updates, state, params)
        assert out is updates
        params = optax.apply_updates(params, updates)
        want = jax.tree.map(lambda e, p: 0.75 * e + 0.25 * np.asarray(p), want, params)
    for k in want:
        np.testing.assert_allclose(np.asarray(trainer_lib.ema_params(state)[k]), want[k], rtol=1e-6)
    with pytest.raises(ValueError, match="ema_decay"):
        trainer_lib.param_ema(1.0)

    task = toy_task()
    config = tiny_config("softmax")
    config.ema_decay = 0.5
    config.mesh_shape = (1, 2)  # FSDP: "embed" params are split over 2 devices
    trainer = Trainer(config, task, devices=jax.devices()[:2])
    ema_shardings = trainer_lib.ema_params(trainer.state_shardings.opt_state)
    param_shardings = trainer.state_shardings.params
    assert jax.tree.structure(ema_shardings) == jax.tree.structure(param_shardings)
    assert jax.tree.leaves(ema_shardings) == jax.tree.leaves(param_shardings)
    assert any(s.spec != PartitionSpec() for s in jax.tree.leaves(param_shardings))
    state = trainer.init_state()
    want = jax.device_get(state.params)
    keys = (*trainer.input_keys, "targets")
    for step in range(3):
        batch = trainer.to_global(task.train_batch(step, config.batch_size, seed=0), keys)
        state, _ = trainer.train_step(state, batch)
        want = jax.tree.map(lambda e, p: 0.5 * e + 0.5 * p, want, jax.device_get(state.params))
    got = jax.device_get(trainer.eval_params(state))
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
    ema_eval = trainer.evaluate(state, "val", num_batches=1)
    raw = dataclasses.replace(state, opt_state=trainer.init_state().opt_state[:-1])
    assert trainer_lib.ema_params(raw.opt_state) is None and trainer.eval_params(raw) is raw.params
    raw_eval = trainer.evaluate(raw, "val", num_batches=1)
    assert ema_eval["loss"] != raw_eval["loss"]
    # checkpointed with the optimizer state: restored bitwise, with the params' shardings
    ck = ckpt_lib.Checkpointer(tmp_path, async_save=False)
    ck.save(3, state.as_dict(), {"step": 3})
    restored, _ = ck.restore_latest(trainer.abstract_sharded_state().as_dict())
    ck.close()
    restored = trainer_lib.TrainState.from_dict(restored)
    for x, y in zip(
        jax.tree.leaves(trainer.eval_params(restored)), jax.tree.leaves(got), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(x), y)
    shardings = [x.sharding for x in jax.tree.leaves(trainer.eval_params(restored))]
    assert shardings == jax.tree.leaves(param_shardings)


def test_batch_not_divisible_by_data_devices_is_a_clear_error():
    from train import sharding

    config = configs.get_config("listops", "mini")
    mesh = sharding.make_mesh(config, jax.devices()[:8])
    config.batch_size = 12
    with pytest.raises(ValueError, match=r"batch_size=12 must be a multiple of the 8 devices"):
        sharding.batch_sharding(mesh, config)
    config.batch_size, config.eval_batch_size = 16, 4
    with pytest.raises(ValueError, match=r"eval_batch_size=4"):
        sharding.batch_sharding(mesh, config)
    config.eval_batch_size = 8
    assert sharding.batch_sharding(mesh, config).spec == PartitionSpec(tuple(config.data_axes))


def test_metrics_writer_drops_records_past_the_resume_step(tmp_path):
    from train.metrics import MetricsWriter, read_jsonl

    w = MetricsWriter(tmp_path, tensorboard=False)
    for step in (10, 20, 30, 40):
        w.write(step, "train", {"loss": float(step)})
    w.write(20, "val", {"loss": 1.0})
    w.write(40, "val", {"loss": 2.0})
    w.close()
    w = MetricsWriter(tmp_path, tensorboard=False, resume_step=20)  # crashed after 40, ckpt 20
    w.write(30, "train", {"loss": -30.0})
    w.close()
    raw = read_jsonl(tmp_path / "metrics.jsonl", latest_only=False)
    assert [(r["split"], r["step"], r["loss"]) for r in raw] == [
        ("train", 10, 10.0),
        ("train", 20, 20.0),
        ("val", 20, 1.0),
        ("train", 30, -30.0),
    ]


def test_checkpoint_param_paths_of_every_model():
    """The LRA classifier, the ViT and the LM stack the one `train.models.layers.Block`; the
    parameter paths are those checkpoints held before the blocks were merged."""
    from flax import traverse_util
    from flax.core import meta

    def paths(model, x):
        v = jax.eval_shape(lambda: model.init(jax.random.key(0), x))
        return {"/".join(k) for k in traverse_util.flatten_dict(meta.unbox(v["params"]))}

    block = {
        f"block_0/{p}/{w}"
        for p, ws in {
            "attention/key": "bk",
            "attention/query": "bk",
            "attention/value": "bk",
            "attention/out": "bk",
            "mlp/wi": "bk",
            "mlp/wo": "bk",
            "ln_attention": "bs",
            "ln_mlp": "bs",
        }.items()
        for w in {"b": "bias", "k": "kernel", "s": "scale"}.values()
        if w[0] in ws
    }
    sizes = dict(num_layers=1, emb_dim=8, num_heads=2, mlp_dim=8)
    enc = models.Encoder(vocab_size=5, max_len=4, qkv_dim=8, **sizes)
    lra = paths(models.EncoderClassifier(encoder=enc, num_classes=2), jnp.ones((1, 4), jnp.int32))
    assert lra == {f"encoder/{p}" for p in block} | {
        "encoder/cls",
        "encoder/embed/embedding",
        "encoder/ln_final/bias",
        "encoder/ln_final/scale",
        "encoder/pos_embed",
        "head/hidden/bias",
        "head/hidden/kernel",
        "head/logits/bias",
        "head/logits/kernel",
    }
    final = {"ln_final/bias", "ln_final/scale", "pos_embed"}
    lm = paths(models.CausalLM(max_len=4, qkv_dim=8, **sizes), jnp.ones((1, 4), jnp.int32))
    assert lm == block | final | {"embed/embedding"}
    vit = models.ViT(num_classes=2, image_size=(8, 8), patch_size=4, **sizes)
    got = paths(vit, jnp.ones((1, 8, 8, 3), jnp.uint8))
    assert got == block | final | {"cls", "head/bias", "head/kernel"} | {
        "patch_embed/bias",
        "patch_embed/kernel",
    }
    assert models.EncoderBlock is models.Block and models.MlpBlock is models.Mlp


def test_mesh_of_fewer_devices_takes_the_first_ones():
    """A shape without -1 takes the first prod(shape) devices in one process; -1 takes them
    all; more than there are is an error naming both counts."""
    from train import sharding

    config = configs.get_config("listops", "mini")
    devices = jax.devices()[:8]
    for shape, want in (((1, 1), devices[:1]), ((2, 2), devices[:4]), ((-1, 2), devices)):
        config.mesh_shape = shape
        assert list(sharding.make_mesh(config, devices).devices.flat) == want, shape
    config.mesh_shape = (4, 4)
    with pytest.raises(ValueError, match=r"needs 16 devices, have 8"):
        sharding.make_mesh(config, devices)
