"""End to end: ``python -m train`` on every task, kill -9 and resume, the results command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from _helpers import SMALL_CONFIG, TINY_CLI

import linattn_jax as la
from train.__main__ import main
from train.metrics import read_jsonl

TINY = [
    *TINY_CLI,
    "--set=log_every=1",
    "--set=num_eval_batches=2",
    "--set=data.num_train=48",
    "--set=data.num_val=16",
    "--set=data.num_test=16",
]


def _check_run_outputs(workdir: Path, steps: int, num_val: int = 16):
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == steps
    records = read_jsonl(workdir / "metrics.jsonl")
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert all(np.isfinite(r["loss"]) and 0 <= r["accuracy"] <= 1 for r in train)
    evals = [r for r in records if r["split"] == "val"]
    assert evals and evals[-1]["step"] == steps and evals[-1]["count"] == num_val
    assert (workdir / "checkpoints" / str(steps)).is_dir()
    assert list((workdir / "best").iterdir())
    assert list((workdir / "tb").glob("events.out.tfevents.*"))
    png = (workdir / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    return summary


def _train_losses(workdir: Path) -> dict[int, float]:
    """``{step: train loss}`` from a run's metrics.jsonl."""
    return {
        r["step"]: r["loss"] for r in read_jsonl(workdir / "metrics.jsonl") if r["split"] == "train"
    }


def _aan_fixture(folder: Path, n: int = 48):
    rng = np.random.default_rng(0)
    words = ["attention", "linear", "kernel", "graph", "parser", "speech", "vision", "tree"]
    folder.mkdir(parents=True)
    for split in ("train", "eval", "test"):
        lines = []
        for i in range(n):
            a = " ".join(rng.choice(words, 6))
            b = " ".join(rng.choice(words, 6))
            lines.append(f"{float(i % 2)}\tp{i}\tq{i}\t{a}\t{b}\n")
        (folder / f"new_aan_pairs.{split}.tsv").write_text("".join(lines))


@pytest.mark.parametrize("task", ["listops", "pathfinder", "retrieval", "text", "image"])
def test_cli_every_task(task, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data_dir = tmp_path / "data"
    args = [f"--task={task}", "--attention=linear_elu", "--steps=3", f"--data_dir={data_dir}"]
    args += TINY + ["--set=eval_every=2", "--set=checkpoint_every=2"]
    if task in ("listops", "text", "retrieval"):
        args.append("--set=data.seq_len=32")
    if task == "retrieval":
        _aan_fixture(data_dir / "aan")
    if task in ("text", "image"):
        tfds = pytest.importorskip("tensorflow_datasets")
        with tfds.testing.mock_data(num_examples=40):
            summary = main(args)
    else:
        summary = main(args)
    workdir = tmp_path / "workdir" / f"{task}_mini_linear_elu"  # the default workdir
    out = _check_run_outputs(workdir, 3, num_val=4 if task == "image" else 16)  # image: 10% of 40
    assert out["task"] == summary["task"] == task
    assert 0.0 <= summary["test"]["accuracy"] <= 1.0 and 0.0 < summary["test"]["majority"] <= 1.0


def _params_of(workdir: Path, step: int):
    with ocp.CheckpointManager(workdir / "checkpoints") as mngr:
        restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    return restored["state"]["params"]


def test_kill_and_resume_matches_uninterrupted(tmp_path):
    steps = 30
    data_dir = tmp_path / "data"
    args = ["--attention=performer", f"--steps={steps}", f"--data_dir={data_dir}", *TINY]
    args += [
        "--set=data.seq_len=32",
        "--set=attention_config.num_features=8",
        "--set=redraw_every=7",  # the trainer's redraw, across the resumes
        "--set=model.dropout_rate=0.1",  # dropout rng
        "--set=eval_every=15",
        "--set=checkpoint_every=5",
        "--set=max_to_keep=20",
        "--set=eval_test=False",
    ]
    # Uninterrupted reference (in process; same devices as the subprocess: conftest's 8).
    main([*args, f"--workdir={tmp_path / 'ref'}"])
    # The same run in a subprocess, SIGKILLed right after its first checkpoint lands.
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "train", *args, f"--workdir={run_dir}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 300
    try:
        while time.time() < deadline and proc.poll() is None:
            ckpts = run_dir / "checkpoints"
            if ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir()):
                break
            time.sleep(0.02)
        assert proc.poll() is None, (
            f"run ended before the kill: {proc.stderr.read().decode()[-2000:]}"
        )
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "summary.json").exists()  # it really died mid-run
    # Restart: resumes from the newest complete checkpoint and finishes.
    summary = main([*args, f"--workdir={run_dir}"])
    assert 0 < summary["resumed_from"] < steps
    ref = json.loads((tmp_path / "ref" / "summary.json").read_text())
    # Same step counter, data position and rng stream: the resumed trajectory (per-step
    # train loss after the restart) and the final params are bitwise the uninterrupted ones.
    resumed, reference = _train_losses(run_dir), _train_losses(tmp_path / "ref")
    tail = range(summary["resumed_from"] + 1, steps + 1)
    assert [resumed[s] for s in tail] == [reference[s] for s in tail]
    raw = read_jsonl(run_dir / "metrics.jsonl", latest_only=False)  # each step written once
    assert len({(r["split"], r["step"]) for r in raw}) == len(raw)
    assert summary["train"]["loss"] == ref["train"]["loss"]
    assert summary["val"]["accuracy"] == ref["val"]["accuracy"]
    got, want = _params_of(run_dir, steps), _params_of(tmp_path / "ref", steps)
    import jax

    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_results_command_smoke(tmp_path):
    from train import results

    rows = results.main(
        [
            "--tasks=listops",
            "--attentions=linear_elu",
            "--steps=2",
            f"--workdir={tmp_path}",
            "--no_progress",
            f"--set=data.data_dir={tmp_path / 'data'}",
            "--set=data.seq_len=32",
            *[a for a in TINY if a.startswith("--set=")],
            "--set=eval_every=2",
        ]
    )
    assert [r["attention"] for r in rows] == ["linear_elu"] and "summary" in rows[0]
    table = (tmp_path / "results.md").read_text()
    acc = 100 * rows[0]["summary"]["test"]["accuracy"]
    assert f"| linear_elu | {acc:.1f} | {acc:.1f} |" in table and "majority" in table
    assert (tmp_path / "results.png").read_bytes()[:4] == b"\x89PNG"


def test_results_table_layout(tmp_path):
    from train import results

    def row(task, attention, acc, majority=0.25):
        test = {"accuracy": acc, "majority": majority}
        summary = {"test": test, "val": test, "params": 1000, "steps_per_sec": 2.0, "best": {}}
        return {"task": task, "attention": attention, "summary": summary}

    rows = [
        row("listops", "softmax", 0.30),
        row("pathfinder", "softmax", 0.60, 0.5),
        row("listops", "performer", 0.20),
        {"task": "pathfinder", "attention": "performer", "error": "DatasetNotFoundError: x"},
    ]
    table = results.markdown_table(rows, steps=10)
    assert "| attention | listops | pathfinder | mean |" in table
    assert "| softmax | 30.0 | 60.0 | 45.0 |" in table
    assert "| performer | 20.0 | error | — |" in table
    assert "| *majority class* | 25.0 | 50.0 | |" in table
    assert results.plot(rows, tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_flags_and_missing_data(tmp_path):
    from train.__main__ import build_config, parse_args
    from train.data import DatasetNotFoundError

    args, overrides = parse_args(
        ["--task=pathfinder", "--steps=7", "--config.model.num_layers=3", "--set", "seed=5"]
    )
    config = build_config(args, overrides)
    assert (config.task, config.num_train_steps, config.model.num_layers, config.seed) == (
        "pathfinder",
        7,
        3,
        5,
    )
    assert config.model.pooling == "mean" and config.attention == "flexformer_n"
    with pytest.raises(SystemExit):
        parse_args(["--bogus=1"])
    with pytest.raises(DatasetNotFoundError, match="imdb_reviews"):
        main(["--task=text", f"--data_dir={tmp_path}", f"--workdir={tmp_path / 'w'}"])


def test_distill_cli_run_and_transfer(tmp_path, monkeypatch, capsys):
    """``python -m train.distill run`` (teacher, stage 1), then ``transfer``
    of its feature maps to a task B (whose teacher it trains): every output is written."""
    from train import distill

    monkeypatch.chdir(tmp_path)
    common = ["--student=hedgehog", "--stage1_steps=3", "--block_size=8"]
    common += [f"--data_dir={tmp_path / 'data'}", *TINY, "--set=num_train_steps=2"]
    common += ["--set=eval_every=2", "--set=checkpoint_every=2"]
    summary = distill.main(  # stage 2 is the ordinary loop (tested in test_distill.py)
        ["run", "--task=listops", "--train_teacher", "--no_stage2", *common]
        + ["--set=data.seq_len=32"]
    )
    out = capsys.readouterr().out
    run_dir = tmp_path / "workdir" / "distill" / "listops_mini_hedgehog"
    assert "training the softmax teacher in workdir/listops_mini_softmax" in out
    assert distill.format_summary(summary) in out
    assert summary["stage1"]["steps"] == 3 and "stage2" not in summary
    assert json.loads((run_dir / "distill_summary.json").read_text())["task"] == "listops"
    _check_run_outputs(tmp_path / "workdir" / "listops_mini_softmax", 2)
    maps, info = distill.load_feature_maps(run_dir / "feature_maps.msgpack")
    assert info["task"] == "listops" and len(maps) == 1

    source = str(run_dir / "feature_maps.msgpack")
    # task B: ListOps generated from another seed, with its own teacher (cross-task transfer
    # is measured in tests/test_distill.py; this checks the command and its outputs)
    b = ["--teacher_workdir=teacher_b", "--workdir=transfer_b", "--set=data.data_seed=1"]
    s = distill.main(
        ["transfer", "--task=listops", f"--source={source}", "--train_teacher", *b]
        + common
        + ["--set=data.seq_len=32"]
    )
    out = capsys.readouterr().out
    assert "training the softmax teacher in teacher_b" in out
    _check_run_outputs(tmp_path / "teacher_b", 2)
    assert s["source_task"] == s["task"] == "listops" and s["student"] == "hedgehog"
    for name in ("own", "transferred", "init"):
        assert np.isfinite(s[name]["attention_kl"]) and f"{name:12s} maps" in out
    assert "transfer drop" in out
    saved = tmp_path / "transfer_b" / "transfer_summary.json"
    assert json.loads(saved.read_text())["drop"] == s["drop"]
    # maps of another mechanism are refused before any teacher is trained
    with pytest.raises(ValueError, match="holds 'hedgehog' maps, not 'performer'"):
        distill.main(
            [
                "transfer",
                "--task=text",
                f"--source={source}",
                "--train_teacher",
                "--student=performer",
                *common[1:],
            ]
        )
    assert "training the softmax teacher" not in capsys.readouterr().out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _multiprocess_run(args, workdir, steps, num_processes=2, devices_per_process=2):
    """``python -m train --distributed`` as `num_processes` local CPU processes (gloo)."""
    port = _free_port()
    flags = os.environ.get("XLA_FLAGS", "").split()  # conftest's collective timeouts stay
    flags = [f for f in flags if "xla_force_host_platform_device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "train", *args, f"--steps={steps}", f"--workdir={workdir}"]
            + ["--distributed", f"--set=coordinator_address=127.0.0.1:{port}"]
            + [f"--set=num_processes={num_processes}", f"--set=process_id={i}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(num_processes)
    ]
    try:
        outs = [p.communicate(timeout=180)[0].decode() for p in procs]
    finally:
        for p in procs:  # a hung process (e.g. a failed cross-process barrier) is killed
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return outs


def test_multiprocess_training_and_resume_match_one_process(tmp_path):
    """Two processes x 2 CPU devices (jax.distributed, gloo collectives), 2 steps, then a
    second launch resuming to 4: the same metrics as one process over the conftest's 8
    devices (float32 reductions split differently: rtol 1e-5), one summary, one set of
    checkpoints (latest and best saved at the same step by both processes)."""
    data_dir = tmp_path / "data"
    args = ["--attention=linear_elu", f"--data_dir={data_dir}", *TINY, "--set=data.seq_len=32"]
    args += ["--set=eval_every=2", "--set=checkpoint_every=2", "--set=async_checkpointing=True"]
    main([*args, "--steps=4", f"--workdir={tmp_path / 'ref'}"])  # data generated here
    run = tmp_path / "multi"
    outs = _multiprocess_run(args, run, steps=2)
    assert "devices 4 x cpu" in outs[0] and "== listops" in outs[0]
    assert "== listops" not in outs[1]  # only process 0 prints the summary
    outs = _multiprocess_run(args, run, steps=4)
    assert "resuming at step 2" in outs[0]
    summary = _check_run_outputs(run, 4)
    assert summary["resumed_from"] == 2
    ref = json.loads((tmp_path / "ref" / "summary.json").read_text())
    for split in ("val", "test"):
        for key in ("loss", "accuracy", "count"):
            np.testing.assert_allclose(summary[split][key], ref[split][key], rtol=1e-5)
    train, ref_train = _train_losses(run), _train_losses(tmp_path / "ref")
    assert sorted(train) == sorted(ref_train) == [1, 2, 3, 4]
    np.testing.assert_allclose(
        [train[s] for s in range(1, 5)], [ref_train[s] for s in range(1, 5)], rtol=1e-5
    )


# ------------------------------------------------------------------ every entry x mechanism
_SMOKE_SETS = [
    *[a for a in TINY_CLI if a.startswith("--set=")],
    "--set=eval_every=2",
    "--set=checkpoint_every=2",
    "--set=num_eval_batches=1",
    "--set=eval_test=False",
    "--set=tensorboard=False",
    "--set=plot=False",
    "--set=async_checkpointing=False",
]


@pytest.fixture(scope="module")
def smoke_data(tmp_path_factory):
    """One small ListOps cache and one small text file for every mechanism's smoke runs."""
    root = tmp_path_factory.mktemp("smoke_data")
    text = root / "corpus.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 40)
    return root, text


def _entry_argvs(attention, data_dir, text, workdir):
    """``{entry: argv}`` of every entry point that accepts `attention`, at tiny settings."""
    small = [f"--set=attention_config.{k}={v}" for k, v in SMALL_CONFIG.get(attention, {}).items()]
    common = [f"--attention={attention}", "--steps=2", "--no_progress", *_SMOKE_SETS, *small]
    lra = [
        f"--set=data.data_dir={data_dir}",
        "--set=data.seq_len=32",
        "--set=data.num_train=32",
        "--set=data.num_val=8",
        "--set=data.num_test=8",
    ]
    out = {
        "train": [*common, *lra, f"--workdir={workdir / 'train'}"],
        "results": [
            "--tasks=listops",
            f"--attentions={attention}",
            f"--workdir={workdir / 'results'}",
            *[a for a in common if not a.startswith("--attention=")],
            *lra,
        ],
        "vision": [
            *common,
            f"--workdir={workdir / 'vit'}",
            f"--set=data.tfds_data_dir={workdir / 'tfds'}",
            "--set=data.image_size=16",
            "--set=model.patch_size=4",
        ],
    }
    if attention in la.causal_names():
        out["lm"] = [
            *common,
            f"--workdir={workdir / 'lm'}",
            "--num_tokens=2",
            f"--set=data.path={text}",
            "--set=data.seq_len=16",
            "--set=data.val_fraction=0.2",
        ]
    return out


def _entry_config(entry, argv):
    from train import __main__ as train_main
    from train import lm, results, vision

    if entry == "train":
        return train_main.config_from_argv(argv)[2]
    if entry == "results":
        (config,) = results.configs_from_argv(argv)[2]
        return config
    if entry == "vision":
        return vision.config_from_argv(argv)
    return lm.config_from_argv(argv)[1]


def _run_entry(entry, argv):
    from train import lm, results, vision

    if entry == "train":
        return main(argv)
    if entry == "results":
        (row,) = results.main(argv)
        assert "error" not in row, row["error"]
        return row["summary"]
    if entry == "vision":
        return vision.main(argv)
    return lm.main(argv)["summary"]


#: the mechanisms whose test also runs one entry point's ``main`` for two real steps (the
#: others only trace: compiling every pair takes minutes), with XLA's optimisations off (half
#: the compile time); ``python -m train`` runs for real in test_cli_every_task, and train.lm
#: also with softmax and hedgehog in tests/test_lm.py
REAL_RUN = {"performer": "results", "lara": "vision", "flexformer_n": "lm"}


@pytest.mark.parametrize("attention", la.names())
def test_every_entry_point_runs_every_mechanism(attention, smoke_data, tmp_path):
    """Every entry point this package owns, with every mechanism it accepts, at tiny settings:
    the command line -> config -> data, model, sharded state -> one train and one eval step
    traced (forward, backward, optimiser; nothing compiled), the guard against one preset's
    mechanism settings leaking into another (``train.lm --attention softmax`` once crashed on
    flexformer's ``num_features``). For the mechanisms of `REAL_RUN` one entry point also
    runs its ``main`` for two real steps.
    """
    from train.trainer import Trainer

    tfds = pytest.importorskip("tensorflow_datasets")
    data_dir, text = smoke_data
    argvs = _entry_argvs(attention, data_dir, text, tmp_path)
    with tfds.testing.mock_data(num_examples=16):
        for entry, argv in argvs.items():
            trainer = Trainer(_entry_config(entry, argv))
            state = trainer.abstract_sharded_state()
            new_state, metrics = jax.eval_shape(trainer.train_step, state, trainer.batch_spec())
            assert jax.tree.structure(new_state) == jax.tree.structure(state), entry
            assert metrics["loss"].shape == (), entry
            eval_batch = {**trainer.batch_spec(), "mask": jax.ShapeDtypeStruct((8,), bool)}
            jax.eval_shape(trainer.eval_step, state.params, state.extra, eval_batch)
        entry = REAL_RUN.get(attention)
        if entry:
            summary = _run_entry(entry, argvs[entry])
    if entry:
        assert summary["steps"] == 2 and np.isfinite(summary["val"]["loss"]), entry
