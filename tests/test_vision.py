"""train.vision: ViT with every mechanism on mocked ImageNet / CIFAR (sharded steps), the
grid landmarks, augmentation, Mixup/CutMix and the DeiT-tiny recipe."""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import max_rel_err

import linattn_jax as la
from linattn_jax import registry
from train import configs, vision
from train import trainer as trainer_lib
from train.data import DatasetNotFoundError

tfds = pytest.importorskip("tensorflow_datasets")

_SMALL = {"num_features": 8, "num_landmarks": 4, "num_samples": 1}


def _small_config(name):
    defaults = la.get(name).defaults
    return {k: v for k, v in _SMALL.items() if k in defaults}


def _config(tmp_path, dataset, attention):
    c = configs.get_config("vit", "mini")
    c.attention = attention
    c.attention_config = _small_config(attention)
    c.data.update(
        dataset=dataset,
        image_size=16,
        tfds_data_dir=str(tmp_path),
        num_train=None,
        num_val=None,
        num_test=None,
    )
    c.model.update(
        patch_size=4, emb_dim=32, num_layers=1, num_heads=2, mlp_dim=64, drop_path_rate=0.1
    )
    c.update(batch_size=8, eval_batch_size=8, learning_rate=1e-3, warmup_steps=1)
    return c


@pytest.fixture
def grid_spy(monkeypatch):
    """Records the config every mechanism call receives (the registry entry is wrapped)."""
    seen = []
    for name in la.names():
        mech = registry.get(name)

        @functools.wraps(mech.attention_fn)
        def spy(*args, _fn=mech.attention_fn, _name=name, **kwargs):
            seen.append((_name, kwargs.get("grid", "absent")))
            return _fn(*args, **kwargs)

        monkeypatch.setitem(registry._REGISTRY, name, dataclasses.replace(mech, attention_fn=spy))
    return seen


@pytest.mark.parametrize("attention", la.names())
def test_vit_sharded_steps_every_mechanism(tmp_path, grid_spy, attention):
    """Two sharded train steps (8 devices) and an eval batch on mocked imagenet2012.

    (An earlier intermittent SIGABRT here was XLA's CPU in-process all-reduce rendezvous
    giving up under heavy machine load -- ``AwaitAndLogIfStuck`` in
    ``InProcessCommunicator::AllReduce``, found with gdb -- not a donated buffer; XLA_FLAGS
    ``--xla_cpu_collective_call_terminate_timeout_seconds=3600`` in conftest removes it.)
    """
    with tfds.testing.mock_data(num_examples=16):
        trainer = trainer_lib.Trainer(_config(tmp_path, "imagenet2012", attention))
        assert dict(trainer.mesh.shape) == {"data": 8, "fsdp": 1}
        state = trainer.init_state()
        before = jax.tree.map(np.asarray, state.params)
        batches = trainer.data.train_batches(8, seed=0)
        for _ in range(2):
            batch = next(batches)
            assert batch["inputs"].shape == (8, 16, 16, 3) and batch["inputs"].dtype == np.uint8
            state, metrics = trainer.train_step(
                state, trainer.to_global(batch, ("inputs", "targets"))
            )
        result = trainer.evaluate(state, "val", num_batches=1)
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(result["loss"])
    assert result["count"] == 8.0 and 0.0 <= result["top5"] <= 1.0
    changed = jax.tree.map(lambda a, b: not np.allclose(a, np.asarray(b)), before, state.params)
    assert all(jax.tree.leaves(changed["block_0"]["mlp"]))
    grids = {g for n, g in grid_spy if n == attention}
    if "grid" in la.get(attention).defaults:  # the 4 x 4 patch grid reached the mechanism
        assert grids == {(4, 4)}, grids
    elif attention in ("softmax", "ra"):  # the modules run flax's dot_product_attention and
        assert grids == set(), grids  # la.ra.ra_flax_attention (any flax mask) for these
    else:
        assert grids == {"absent"}


def test_vit_cifar10_and_grid_config(tmp_path):
    with tfds.testing.mock_data(num_examples=20):
        c = _config(tmp_path, "cifar10", "laplacian")
        c.data.image_size = 32
        c.model.update(mixup_alpha=0.8, cutmix_alpha=1.0)
        trainer = trainer_lib.Trainer(c)
        assert trainer.data.num_examples("train") == 18 and trainer.data.num_examples("val") == 2
        assert dict(trainer.model.block_attention_config())["grid"] == (8, 8)
        state = trainer.init_state()
        batch = trainer.data.train_batch(0, 8)
        state, metrics = trainer.train_step(state, trainer.to_global(batch, ("inputs", "targets")))
        assert np.isfinite(float(metrics["loss"]))
        # an explicit grid is kept; mechanisms without grid get none
        assert dict(
            vision.attention_config(
                "lara" if "lara" in la.names() else "soft", {"grid": (2, 2)}, (8, 8)
            )
        )["grid"] == (2, 2)
        assert vision.attention_config("performer", {"num_features": 8}, (8, 8)) == (
            ("num_features", 8),
        )


def test_missing_imagenet(tmp_path):
    c = _config(tmp_path, "imagenet2012", "softmax")
    with pytest.raises(DatasetNotFoundError, match="manual_dir MANUAL_DIR"):
        vision.build_image_task(c.data.to_dict())


# ---------------------------------------------------------------- augmentation
def test_random_resized_crop_and_center_crop():
    img = np.arange(40 * 60 * 3, dtype=np.int64).reshape(40, 60, 3).astype(np.uint8)
    a = vision.random_resized_crop(img, np.random.default_rng(0), 24)
    b = vision.random_resized_crop(img, np.random.default_rng(0), 24)
    c = vision.random_resized_crop(img, np.random.default_rng(1), 24)
    assert a.shape == (24, 24, 3) and a.dtype == np.uint8
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    # full-scale crops of a constant image stay constant
    flat = np.full((30, 50, 3), 77, np.uint8)
    out = vision.random_resized_crop(flat, np.random.default_rng(2), 16, scale=(1.0, 1.0))
    assert np.all(out == 77)
    cc = vision.center_crop(np.zeros((100, 200, 3), np.uint8), 32)
    assert cc.shape == (32, 32, 3)
    # centre crop of a smooth ramp is centred: mean column value equals the image centre
    ramp = np.broadcast_to(np.linspace(0, 255, 200)[None, :, None], (100, 200, 3)).astype(np.uint8)
    assert abs(vision.center_crop(ramp, 32).mean() - 127.5) < 2.0


def test_pad_crop_flip_is_a_shift_or_flip_of_the_image():
    img = np.random.default_rng(0).integers(1, 255, (8, 8, 3)).astype(np.uint8)
    for seed in range(10):
        out = vision.pad_crop_flip(img, np.random.default_rng(seed), pad=2)
        assert out.shape == img.shape
        cand = [out, out[:, ::-1]]
        ok = False
        for o in cand:
            for dy in range(-2, 3):
                for dx in range(-2, 3):
                    padded = np.pad(img, ((2, 2), (2, 2), (0, 0)))
                    if np.array_equal(o, padded[2 + dy : 10 + dy, 2 + dx : 10 + dx]):
                        ok = True
        assert ok


def test_image_stream_resumable_and_eval_padding():
    rng = np.random.default_rng(0)
    recs = [
        {"image": rng.integers(0, 255, (8, 8, 3)).astype(np.uint8), "label": i % 3}
        for i in range(10)
    ]
    task = vision.ImageTask(
        "toy", {"train": recs, "val": recs[:5]}, 3, (8, 8), augment="pad_crop", flatten=True
    )
    run = [task.train_batch(s, 4, seed=3) for s in range(4)]
    it = task.train_batches(4, seed=3, start_step=2)
    for s in (2, 3):
        np.testing.assert_array_equal(next(it)["inputs"], run[s]["inputs"])
    again = task.train_batch(1, 4, seed=3)
    np.testing.assert_array_equal(again["inputs"], run[1]["inputs"])
    assert run[0]["inputs"].shape == (4, 192) and run[0]["inputs"].dtype == np.int32
    evals = list(task.eval_batches("val", 4))
    assert [e["mask"].tolist() for e in evals] == [[True] * 4, [True, False, False, False]]
    np.testing.assert_array_equal(evals[1]["inputs"][0], recs[4]["image"].reshape(-1))
    parts = [task.train_batch(0, 4, seed=3, process_index=p, process_count=2) for p in range(2)]
    np.testing.assert_array_equal(
        np.stack([parts[0]["targets"], parts[1]["targets"]], 1).reshape(-1), run[0]["targets"]
    )


def test_mixup_cutmix_and_loss():
    imgs = jax.random.uniform(jax.random.key(0), (6, 8, 8, 3))
    for seed in range(6):
        key = jax.random.key(seed)
        mixed, lam = vision.mix_images(key, imgs, mixup_alpha=0.0, cutmix_alpha=1.0)
        # CutMix: every pixel comes from the image or its partner, lam = own-pixel fraction
        own = jnp.all(mixed == imgs, axis=-1)[0]
        assert bool(jnp.all(own | jnp.all(mixed == imgs[::-1], axis=-1)[0]))
        assert float(lam) == pytest.approx(float(jnp.mean(own)), abs=1e-6)
        mixed, lam = vision.mix_images(key, imgs, mixup_alpha=0.8, cutmix_alpha=0.0)
        np.testing.assert_allclose(mixed, lam * imgs + (1 - lam) * imgs[::-1], rtol=1e-6)
        assert 0.0 <= float(lam) <= 1.0
    logits = jax.random.normal(jax.random.key(1), (4, 10))
    batch = {"targets": jnp.asarray([1, 2, 3, 4])}
    w = jnp.ones((4,))
    out = vision.vit_loss({"logits": logits, "mix_lam": jnp.float32(0.3)}, batch, w)
    onehot = jax.nn.one_hot(batch["targets"], 10)
    soft = 0.3 * onehot + 0.7 * onehot[::-1]
    want = -jnp.sum(soft * jax.nn.log_softmax(logits), -1).sum()
    assert float(out["loss"][0]) == pytest.approx(float(want), rel=1e-5)
    plain = vision.vit_loss(logits, batch, w, label_smoothing=0.1)
    smooth = onehot * 0.9 + 0.01
    want = -jnp.sum(smooth * jax.nn.log_softmax(logits), -1).sum()
    assert float(plain["loss"][0]) == pytest.approx(float(want), rel=1e-5)


def test_deit_tiny_recipe_and_size():
    c = configs.get_config("vit", "deit_tiny")
    assert c.learning_rate == pytest.approx(5e-4 * c.batch_size / 512)
    assert (c.weight_decay, c.label_smoothing, c.model.drop_path_rate) == (0.05, 0.1, 0.1)
    assert c.warmup_steps == 5 * (1_281_167 // c.batch_size) and c.schedule == "cosine"
    assert c.num_train_steps == 300 * (1_281_167 // c.batch_size)
    model = vision.build_vit(c, num_classes=1000, image_size=(224, 224))
    shapes = jax.eval_shape(
        lambda: model.init({"params": jax.random.key(0)}, jnp.zeros((1, 224, 224, 3), jnp.uint8))
    )
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes["params"]))
    assert abs(n - 5_717_416) / 5_717_416 < 0.001, n  # DeiT-tiny: 5.72M parameters


def test_vit_bfloat16_compute():
    """``model.dtype = "bfloat16"`` reaches the ViT: float32 logits within 16 bf16 ulp of the
    float32 model's scale (patch embedding, 2 blocks, head; measured 0.8%), params float32."""
    c = configs.get_config("vit", "mini")
    c.model.update(num_layers=2, emb_dim=32, num_heads=2, mlp_dim=64)
    m32 = vision.build_vit(c, num_classes=10, image_size=(16, 16))
    c.model.dtype = "bfloat16"
    m16 = vision.build_vit(c, num_classes=10, image_size=(16, 16))
    assert m16.dtype == jnp.bfloat16
    images = jax.random.randint(jax.random.key(0), (4, 16, 16, 3), 0, 256).astype(jnp.uint8)
    variables = m32.init({"params": jax.random.key(1)}, images)
    want, got = m32.apply(variables, images), m16.apply(variables, images)
    assert got.dtype == jnp.float32
    assert {x.dtype for x in jax.tree.leaves(variables)} == {jnp.dtype(jnp.float32)}
    err = max_rel_err(got, want)
    assert 1e-4 < err < 16 * 2.0**-8, err


def test_weight_decay_skips_position_and_cls_tokens():
    """DeiT's decay mask: kernels decayed; biases (the q/k/v ones are [heads, head_dim]),
    norms, pos_embed, cls and mechanism params not. With zero gradients AdamW's update is
    exactly ``-lr * wd * p`` on the decayed params and 0 elsewhere."""
    c = configs.get_config("vit", "cifar")
    c.attention, c.attention_config = "flexformer_n", {"num_features": 4}
    c.model.update(num_layers=1, emb_dim=8, num_heads=2, mlp_dim=8)
    c.warmup_steps = 0
    model = vision.build_vit(c, num_classes=3, image_size=(8, 8))
    params = model.init({"params": jax.random.key(0)}, jnp.zeros((1, 8, 8, 3), jnp.uint8))
    params = jax.tree.map(lambda x: x + 1.0, nn.unbox(params["params"]))  # no zero params
    opt, schedule = trainer_lib.make_optimizer(c)
    updates, _ = opt.update(jax.tree.map(jnp.zeros_like, params), opt.init(params), params)
    lr_wd = float(schedule(0)) * c.weight_decay
    decayed = set()
    for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]:
        name = "/".join(p.key for p in path)
        p = params
        for k in path:
            p = p[k.key]
        if np.any(np.asarray(u) != 0):
            np.testing.assert_allclose(np.asarray(u), -lr_wd * np.asarray(p), rtol=1e-5)
            decayed.add(name)
    assert decayed == {
        "patch_embed/kernel",
        "block_0/attention/query/kernel",
        "block_0/attention/key/kernel",
        "block_0/attention/value/kernel",
        "block_0/attention/out/kernel",
        "block_0/mlp/wi/kernel",
        "block_0/mlp/wo/kernel",
        "head/kernel",
    }, decayed
