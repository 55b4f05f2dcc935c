"""train.distill: the blockwise attention-matching loss, q/k capture, weight transplant, and
an end-to-end distillation of a small softmax ViT teacher (trained in the test)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linattn_jax as la
from linattn_jax import core, softmax
from train import configs, distill, kernel_diagnostics, loop, models
from train import trainer as trainer_lib
from train.data.images import ImageTask


def _naive_loss(q, k, params, name, mask, causal):
    """Full T x T teacher / student weights: KL(p || relu(a)/sum) + negative mass fraction."""
    fmap = distill.student_feature_map(name)
    p = softmax.attention_weights(q, k, mask=mask, causal=causal)  # [B, H, T, T]
    a = jnp.einsum(
        "bihm,bjhm->bhij",
        fmap(q, params, is_query=True, mask=None),
        fmap(k, params, is_query=False, mask=mask),
    )
    t = q.shape[1]
    allowed = jnp.ones((t, t), bool)[None, None]
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    if causal:
        allowed = allowed & jnp.tril(jnp.ones((t, t), bool))[None, None]
    a = jnp.where(allowed, a, 0.0)
    pos, neg = jnp.maximum(a, 0), jnp.maximum(-a, 0)
    s = pos / core.guard_denominator(jnp.sum(pos, -1, keepdims=True))
    log_s = jnp.log(jnp.where(allowed, jnp.maximum(s, distill.WEIGHT_FLOOR), 1.0))
    kl = jnp.sum(jnp.where(p > 0, p * (jnp.log(jnp.where(p > 0, p, 1.0)) - log_s), 0.0), -1)
    kl = kl + jnp.sum(neg, -1) / core.guard_denominator(jnp.sum(pos + neg, -1))
    rows = jnp.ones(q.shape[:2]) if mask is None else mask.astype(jnp.float32)
    return jnp.sum(kl * rows[:, None, :]), jnp.sum(rows) * q.shape[2]


@pytest.mark.parametrize(
    ("name", "causal"), [("hedgehog", False), ("flexformer_n", True), ("performer", False)]
)
def test_blockwise_loss_equals_naive(name, causal):
    b, t, h, d = 2, 11, 2, 8
    q = jax.random.normal(jax.random.key(0), (b, t, h, d))
    k = jax.random.normal(jax.random.key(1), (b, t, h, d))
    mask = None if causal else jnp.arange(t)[None, :] < jnp.asarray([[t], [7]])
    mech = la.get(name).bind(**({"num_features": 16} if name != "hedgehog" else {}))
    params = mech.init(jax.random.key(2), num_heads=h, head_dim=d)
    fmap = distill.student_feature_map(name)

    def blockwise(p):
        return distill.attention_kl(q, k, p, fmap, mask=mask, causal=causal, block_size=4)

    # jitted: eager op-by-op dispatch compiles each primitive on its own (2-4x slower)
    naive = jax.jit(lambda p: _naive_loss(q, k, p, name, mask, causal))
    (s, c), (s0, c0) = jax.jit(blockwise)(params), naive(params)
    assert float(c) == float(c0)
    np.testing.assert_allclose(float(s), float(s0), rtol=1e-4)
    if name != "performer":  # gradients w.r.t. the feature-map params
        g = jax.jit(jax.grad(lambda p: blockwise(p)[0]))(params)
        g0 = jax.jit(jax.grad(lambda p: naive(p)[0]))(params)
        # float32: differently ordered sums of trig features (scale: the largest entry of
        # any param's gradient)
        scale = max(float(jnp.max(jnp.abs(y))) for y in jax.tree.leaves(g0))
        for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(g0), strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-3, atol=2e-4 * scale)


def test_loss_is_zero_for_a_perfect_student_and_flags_negative_mass():
    """Features whose kernel is exactly exp(q.k / sqrt d) give 0; negative kernel mass counts."""
    q = jax.random.normal(jax.random.key(0), (1, 5, 1, 4))
    k = jax.random.normal(jax.random.key(1), (1, 5, 1, 4))
    eye = jnp.eye(5)[None, :, None, :]  # key j -> one-hot j

    def exact(x, prm, *, is_query, mask):  # phi(q)_j = exp(q . k_j / 2) (d = 4)
        return jnp.exp(jnp.einsum("bihd,bjhd->bihj", x, k) / 2.0) if is_query else eye

    for causal in (False, True):
        s, c = distill.attention_kl(q, k, {}, exact, causal=causal, block_size=2)
        assert abs(float(s)) < 1e-5 and float(c) == 5.0

    def shifted(x, prm, *, is_query, mask):  # the same minus a constant: some a_ij < 0
        return exact(x, prm, is_query=is_query, mask=mask) - (1.0 if is_query else 0.0)

    s2, _ = distill.attention_kl(q, k, {}, shifted, block_size=2)
    a = np.exp(np.einsum("bihd,bjhd->bij", np.asarray(q), np.asarray(k)) / 2.0) - 1.0
    assert (a < 0).any()
    assert float(s2) > 0.01


def test_capture_attention_calls():
    # LRA encoder with padding, CLS pooling and tied layers: one record per call, CLS mask
    enc = models.Encoder(
        vocab_size=10,
        max_len=6,
        num_layers=3,
        emb_dim=16,
        num_heads=2,
        qkv_dim=16,
        mlp_dim=16,
        tied_layers=True,
    )
    model = models.EncoderClassifier(encoder=enc, num_classes=3)
    tokens = jnp.asarray([[3, 4, 5, 0, 0, 0], [1, 2, 3, 4, 5, 6]])
    variables = jax.jit(model.init)({"params": jax.random.key(0)}, tokens)
    calls = distill.capture_attention(model, variables, tokens, deterministic=True)
    assert [c.path for c in calls] == [("encoder", "block", "attention")] * 3
    want = jnp.concatenate([jnp.ones((2, 1), bool), tokens != 0], axis=1)
    for c in calls:
        assert c.q.shape == c.k.shape == (2, 7, 2, 8) and not c.causal
        np.testing.assert_array_equal(np.asarray(c.mask), np.asarray(want))
    assert not np.allclose(calls[0].q, calls[1].q)  # layer inputs differ
    # the causal LM
    lm_model = models.CausalLM(
        max_len=8, num_layers=2, emb_dim=16, num_heads=2, qkv_dim=16, mlp_dim=16
    )
    toks = jnp.ones((1, 8), jnp.int32)
    lv = jax.jit(lm_model.init)({"params": jax.random.key(0)}, toks)
    calls = distill.capture_attention(lm_model, lv, toks, deterministic=True)
    assert [(c.path, c.causal, c.mask) for c in calls] == [
        (("block_0", "attention"), True, None),
        (("block_1", "attention"), True, None),
    ]
    assert distill.attention_paths(lv) == [("block_0", "attention"), ("block_1", "attention")]


def test_transplant_keeps_student_mechanism_and_fixed():
    x = jnp.zeros((2, 8, 8, 3), jnp.uint8)
    teacher = models.ViT(
        num_classes=3, image_size=(8, 8), emb_dim=16, num_layers=1, num_heads=2, mlp_dim=16
    )
    student = teacher.clone(attention="performer", attention_config=(("num_features", 8),))
    tv = jax.jit(teacher.init)({"params": jax.random.key(0)}, x)
    sv = jax.jit(student.init)({"params": jax.random.key(1)}, x)
    merged, copied, kept = distill.transplant(tv, sv)
    assert ("fixed", "block_0", "attention", "mechanism", "features") in kept
    assert ("params", "block_0", "attention", "query", "kernel") in copied
    np.testing.assert_array_equal(
        merged["params"]["block_0"]["attention"]["query"]["kernel"],
        jax.device_get(tv["params"]["block_0"]["attention"]["query"]["kernel"].value),
    )
    np.testing.assert_array_equal(
        merged["fixed"]["block_0"]["attention"]["mechanism"]["features"],
        sv["fixed"]["block_0"]["attention"]["mechanism"]["features"],
    )
    # the merged student's q/k equal the teacher's: same projections, same inputs
    qt = distill.capture_attention(teacher, tv, x, deterministic=True)[0].q
    qs = distill.capture_attention(student, merged, x, deterministic=True)[0].q
    np.testing.assert_allclose(np.asarray(qs), np.asarray(qt), rtol=1e-6)


# ---------------------------------------------------------------- end to end
def _marks(n, seed, rule):
    """16x16 images: noise and three coloured 4x4 marks on a 4x4 patch grid.

    ``rule="column"``: the label is the column of the red mark; ``"row"``: its row. The
    class is a property of one patch, so the CLS token must attend to the red patch.
    """
    rng = np.random.default_rng(seed)
    imgs = rng.integers(0, 60, size=(n, 16, 16, 3)).astype(np.uint8)
    labels = np.zeros(n, np.int64)
    colours = [(255, 40, 40), (40, 255, 40), (40, 40, 255)]
    for i in range(n):
        cells = rng.choice(16, size=3, replace=False)
        for cell, colour in zip(cells, colours, strict=True):
            r, c = divmod(int(cell), 4)
            imgs[i, 4 * r : 4 * r + 4, 4 * c : 4 * c + 4] = colour
        r, c = divmod(int(cells[0]), 4)
        labels[i] = c if rule == "column" else r
    return [{"image": imgs[i], "label": labels[i]} for i in range(n)]


class _Examples(list):
    """A split's records that print as their count: grain names each transform of the
    training stream by its repr, which includes the task's, and numpy would format every
    pixel of the 2,512 small images (measured: 45 s per stream on the loaded 2-core box, two
    streams per trained run)."""

    def __repr__(self):
        return f"<{len(self)} examples>"


def _task(rule):
    splits = {
        s: _Examples(_marks(n, i, rule))
        for i, (s, n) in enumerate((("train", 2000), ("val", 256), ("test", 256)))
    }
    return ImageTask("marks_" + rule, splits, 4, (16, 16), augment="none")


def _config(student, steps):
    c = configs.get_config("vit", "mini")
    c.attention = student
    c.attention_config = {"num_features": 32} if student.startswith("flex") else {}
    c.model.update(patch_size=4, emb_dim=32, num_layers=2, num_heads=2, mlp_dim=64)
    c.update(
        batch_size=32,
        eval_batch_size=128,
        num_train_steps=steps,
        learning_rate=1e-3,
        warmup_steps=10,
        weight_decay=0.0,
        label_smoothing=0.0,
        eval_every=steps,
        checkpoint_every=steps,
        progress_bar=False,
        tensorboard=False,
        plot=False,
        compile_memory_analysis=False,
        async_checkpointing=False,
        mesh_shape=(1, 1),  # one device: sharded distillation is test_train_cli's CLI run
    )
    return c


@pytest.fixture(scope="module", autouse=True)
def _no_kernel_diagnostics():
    """The trainings here log no kernel diagnostics: nothing here reads them, and they are
    a compile per trained student (test_kernel_diagnostics tests them; test_train_cli's
    distillation run logs them)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernel_diagnostics, "for_run", lambda *args, **kwargs: None)
        yield


@pytest.fixture(scope="module")
def column_teacher(tmp_path_factory):
    """A softmax ViT trained in the test on the "column" marks task (300 steps)."""
    task = _task("column")
    workdir = tmp_path_factory.mktemp("teacher_column")
    config = distill.teacher_config(_config("hedgehog", 300))
    config.learning_rate = 3e-3
    loop.train_and_evaluate(config, workdir, data=task)
    return task, workdir


def _check_flexformer_stage1(column_teacher):
    """Attention matching for flexformer_n (trigonometric features) from the same teacher.

    Measured on seeds 0-2: KL 3.0-5.9 -> 0.13-1.4 (a 3x to 40x reduction; 100 steps). Whether
    the student then classifies well without fine-tuning varied by seed (1.0 on seed 0, chance
    on seeds 1-2 on this sharp one-token attention task), so only the KL is asserted. With
    this test's teacher and 50 steps: 0.56 -> 0.18 (step 25) -> 0.13.
    """
    task, teacher_dir = column_teacher
    config = _config("flexformer_n", 1)
    t_trainer, t_state, _ = trainer_lib.restore_run(
        distill.teacher_config(config), teacher_dir, data=task
    )
    s_trainer = trainer_lib.Trainer(config, task)
    student = distill.init_student(t_state, s_trainer)
    result = distill.distill_attention(
        t_trainer.model,
        trainer_lib.eval_variables(t_state),
        "flexformer_n",
        trainer_lib.eval_variables(student),
        distill.input_batches(s_trainer, seed=1),
        num_steps=50,
        learning_rate=3e-2,
        block_size=8,
        eval_inputs=distill.eval_inputs(s_trainer, 1),
        log_every=25,
    )
    assert result.final_loss < 0.5 * result.initial_loss, result
    assert [step for step, _ in result.history] == [25, 50]
    assert len(result.per_layer) == 2


@pytest.fixture(scope="module")
def column_run(column_teacher, tmp_path_factory):
    """hedgehog distilled from the column teacher: stage 1, stage 2 and the baselines."""
    task, teacher_dir = column_teacher
    workdir = tmp_path_factory.mktemp("distill_column")
    summary = distill.distill(
        _config("hedgehog", 30),
        teacher_workdir=teacher_dir,
        workdir=workdir,
        stage1_steps=50,
        stage1_lr=1e-2,
        block_size=8,
        stage2_lr=1e-4,
        baselines=True,
        data=task,
        log=lambda msg: None,
    )
    return summary, workdir


def test_distillation_end_to_end(column_teacher, column_run, tmp_path):
    """Stage 1 + stage 2 of hedgehog from a trained softmax teacher, with baselines.

    Measured on seeds 0-2 with 150 + 100 steps (the report has every number): teacher
    1.0; attention KL 0.39-0.50 -> 0.007-0.018; accuracy after stage 1 alone 0.79-1.0,
    after stage 2 1.0; the same student from scratch for 250 steps 0.20-0.25 (chance 0.25).
    From the teacher's weights without stage 1, 100 steps gave 0.40-1.0 (hedgehog's
    identity-initialised map is already close to softmax), so that baseline is reported,
    not asserted. This test's run (stage 1 of 50 steps, stage 2 of 30): KL 0.50 -> 0.048,
    accuracy 1.0 after stage 1 and after stage 2, scratch (80 steps) 0.27, teacher weights
    without stage 1 0.79 (with 100 + 60 steps: KL -> 0.024, scratch 0.21).
    """
    s, workdir = column_run
    teacher = s["teacher_val"]["accuracy"]
    assert teacher >= 0.95
    assert s["stage1"]["final_kl"] < 0.2 * s["stage1"]["initial_kl"]
    assert s["after_stage1_val"]["accuracy"] > 0.5  # chance 0.25, majority 0.31
    final = s["stage2"]["val"]["accuracy"]
    assert s["recovery"] == pytest.approx(final / teacher)
    assert final >= 0.9 * teacher  # recovers at least 90% of the teacher's accuracy
    assert final > s["baselines"]["scratch"]["val"]["accuracy"] + 0.3
    assert 0.0 <= s["baselines"]["no_stage1"]["val"]["accuracy"] <= 1.0
    assert s["wall_seconds"] > 0  # the run's own time (the teacher's is in its summary)
    maps, info = distill.load_feature_maps(workdir / "feature_maps.msgpack")
    assert info["student"] == "hedgehog" and set(maps) == {
        ("block_0", "attention"),
        ("block_1", "attention"),
    }
    text = distill.format_summary(s)
    assert "recovered" in text and "stage 1 (50 steps)" in text
    # the same teacher (one per test worker) distilled into flexformer_n: stage 1 only
    _check_flexformer_stage1(column_teacher)
    # the maps distilled here, transferred to the row task: one test, so that pytest-xdist
    # cannot hand it to the other worker, which would train the column teacher a second time
    _check_kernel_transfer(column_run, tmp_path)


def _check_kernel_transfer(column_run, tmp_path):
    """Maps distilled on the column task used on the row task (its own, briefly trained teacher).

    Measured (100 teacher steps, teacher val 0.24, chance; stage 1 of 40 steps on B): attention
    KL on B own 0.019, transferred 0.063, untrained 0.35 (with 150 teacher steps, val 0.53, and
    80 stage-1 steps: 0.009, 0.067, 0.39).
    """
    _, source_dir = column_run
    task = _task("row")
    config = distill.teacher_config(_config("hedgehog", 100))
    config.learning_rate = 3e-3
    loop.train_and_evaluate(config, tmp_path / "teacher_row", data=task)
    s = distill.kernel_transfer(
        _config("hedgehog", 100),
        teacher_workdir=tmp_path / "teacher_row",
        source=source_dir / "feature_maps.msgpack",
        workdir=tmp_path / "transfer",
        stage1_steps=40,
        stage1_lr=1e-2,
        block_size=8,
        data=task,
        log=lambda msg: None,
    )
    assert s["source_task"] == s["task"] == "vit" and s["student"] == "hedgehog"
    kl = {name: s[name]["attention_kl"] for name in ("own", "transferred", "init")}
    assert kl["own"] < kl["transferred"] < 0.5 * kl["init"], kl
    assert s["drop"] == pytest.approx(
        s["own"]["val"]["accuracy"] - s["transferred"]["val"]["accuracy"]
    )
    saved = json.loads((tmp_path / "transfer" / "transfer_summary.json").read_text())
    assert saved["drop"] == pytest.approx(s["drop"])


def test_feature_map_files_check_the_student(tmp_path):
    x = jnp.zeros((1, 8, 8, 3), jnp.uint8)
    cfg = (("num_features", 8),)
    model = models.ViT(
        num_classes=2,
        image_size=(8, 8),
        emb_dim=16,
        num_layers=1,
        num_heads=2,
        mlp_dim=16,
        attention="flexformer_s",
        attention_config=cfg,
    )
    variables = jax.jit(model.init)({"params": jax.random.key(0)}, x)
    maps = distill.trainable_mechanism_params(variables)
    distill.save_feature_maps(tmp_path / "m.msgpack", maps, {"student": "flexformer_s"})
    loaded, info = distill.load_feature_maps(tmp_path / "m.msgpack")
    assert info == {"student": "flexformer_s"}
    np.testing.assert_array_equal(
        loaded[("block_0", "attention")]["omega_tilde"],
        maps[("block_0", "attention")]["omega_tilde"],
    )
    state = trainer_lib.TrainState(step=0, params=variables["params"], extra={}, opt_state=None)
    distill.check_maps_fit(loaded, state, "flexformer_s")
    bigger = model.clone(attention_config=(("num_features", 16),))
    other = jax.jit(bigger.init)({"params": jax.random.key(0)}, x)
    state = trainer_lib.TrainState(step=0, params=other["params"], extra={}, opt_state=None)
    with pytest.raises(ValueError, match="shapes"):
        distill.check_maps_fit(loaded, state, "flexformer_s")
    with pytest.raises(FileNotFoundError):
        distill.load_feature_maps(tmp_path / "missing.msgpack")
    with pytest.raises(ValueError, match="feature-map mechanism"):
        distill.student_config(_config("softmax", 1), "nystromformer")


def test_teacher_variables_are_the_evaluated_params():
    """A teacher trained with a parameter EMA is evaluated with the EMA: distillation must
    capture its attention from the same weights."""
    params = {"w": jnp.ones(3)}
    ema_state = trainer_lib.param_ema(0.5).init({"w": jnp.zeros(3)})
    state = trainer_lib.TrainState(
        step=0, params=params, extra={"fixed": {}}, opt_state=(ema_state,)
    )
    got = trainer_lib.eval_variables(state)
    np.testing.assert_array_equal(got["params"]["w"], np.zeros(3))
    assert got["fixed"] == {}
    state = state.replace(opt_state=())
    np.testing.assert_array_equal(trainer_lib.eval_variables(state)["params"]["w"], np.ones(3))


def test_students_are_the_feature_map_mechanisms():
    """Distillation reads students through the library's feature-map protocol only."""
    names = distill.distillable_names()
    assert names == [n for n in la.names() if la.get(n).feature_map is not None]
    assert "hedgehog" in names and "softmax" not in names
    with pytest.raises(ValueError, match="cannot distill into 'softmax'"):
        distill.student_feature_map("softmax")
    with pytest.raises(ValueError, match="decayed recurrence"):
        distill.student_feature_map("rfa", {"gate": True})


def test_cli_refuses_bad_input_before_any_training(tmp_path, monkeypatch, capsys):
    """``python -m train.distill``: a student without a feature map, ``transfer`` without
    ``--source`` and a missing feature-map file fail before a teacher is built or trained
    (the full ``run`` / ``transfer`` commands: tests/test_train_cli.py)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="cannot distill into 'softmax'"):
        distill.main(["run", "--student=softmax", "--train_teacher"])
    with pytest.raises(SystemExit):
        distill.main(["transfer", "--student=hedgehog"])
    assert "transfer needs --source" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="no feature-map file"):
        distill.main(["transfer", "--student=hedgehog", "--source=missing.msgpack"])
    assert not (tmp_path / "workdir" / "listops_mini_softmax").exists()


def test_restart_deletes_the_runs_under_the_workdir_never_the_teacher(tmp_path):
    """``--restart`` (`stages._prepare`): the run files of every training run under the
    distillation's workdir go (its other files stay); without it nothing is touched; a
    teacher inside the workdir is refused before anything is deleted."""
    from train.distill import stages

    work, teacher = tmp_path / "distill", tmp_path / "teacher"
    for run in (work / "stage2", work / "scratch", teacher):
        (run / "checkpoints").mkdir(parents=True)
        (run / "config.json").write_text("{}")
        (run / "summary.json").write_text("{}")
    (work / "feature_maps.msgpack").write_bytes(b"maps")
    (work / "no_stage1" / "checkpoints").mkdir(parents=True)  # seeded, never trained
    assert stages._prepare(work, teacher, restart=False) == work.absolute()
    assert (work / "stage2" / "summary.json").exists()
    with pytest.raises(ValueError, match="teacher_workdir .* is inside workdir"):
        stages._prepare(tmp_path, teacher, restart=True)
    assert (teacher / "summary.json").exists() and (work / "stage2" / "checkpoints").exists()
    stages._prepare(work, teacher, restart=True)
    for run in ("stage2", "scratch", "no_stage1"):
        assert not (work / run / "checkpoints").exists()
        assert not (work / run / "summary.json").exists()
    assert (work / "feature_maps.msgpack").exists()
    assert (teacher / "checkpoints").exists() and (teacher / "summary.json").exists()


def test_module_runs_as_a_script():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "train.distill", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "python -m train.distill run --task listops" in out.stdout
    assert "--student" in out.stdout and "--stage1_steps" in out.stdout
    assert "--restart" in out.stdout
