"""Training never silently restarts or duplicates (`train.guard`): a workdir of another config
or with no checkpoint that restores is refused in one line and left as it was, a finished run
is read back, bad settings and OS errors are one line before (or naming) what they touch."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from _helpers import TINY_CLI

from train import checkpoint as ckpt_lib
from train import cli, configs, errors, guard, lm, results
from train.__main__ import main
from train.metrics import read_jsonl

STEPS = 2


def _argv(data_dir: Path, workdir: Path, *extra: str) -> list[str]:
    return [
        "--attention=linear_elu",
        f"--steps={STEPS}",
        f"--data_dir={data_dir}",
        f"--workdir={workdir}",
        *TINY_CLI,
        "--set=data.seq_len=32",
        "--set=data.num_train=32",
        "--set=data.num_val=8",
        "--set=data.num_test=8",
        "--set=num_eval_batches=1",
        "--set=eval_every=2",
        "--set=checkpoint_every=2",
        "--set=tensorboard=False",
        "--set=plot=False",
        "--set=async_checkpointing=False",
        *extra,
    ]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """``(data_dir, workdir)`` of a finished 2-step run (copy it before changing it)."""
    root = tmp_path_factory.mktemp("guard")
    data_dir, workdir = root / "data", root / "run"
    main(_argv(data_dir, workdir))
    return data_dir, workdir


def _copy(finished, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(finished[1], dst)
    return dst


def _snapshot(workdir: Path) -> dict[str, str]:
    """``{relative path: sha1}`` of every file under `workdir`."""
    return {
        str(p.relative_to(workdir)): hashlib.sha1(p.read_bytes()).hexdigest()
        for p in sorted(workdir.rglob("*"))
        if p.is_file()
    }


def _refused(capsys, argv, *needles) -> str:
    """Runs the CLI on `argv`: exit status 2, one stderr line holding every needle."""
    assert cli.run(main, argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def test_other_config_is_refused_and_restart_starts_over(finished, tmp_path, capsys):
    data_dir = finished[0]
    run = _copy(finished, tmp_path)
    before = _snapshot(run)
    other = _argv(data_dir, run, "--set=model.mlp_dim=16", "--seed=3")
    _refused(
        capsys,
        other,
        f"workdir {run} holds a run of another config",
        "model.mlp_dim: 32 -> 16",
        "seed: 0 -> 3",
        "new --workdir",
        "--restart",
    )
    assert _snapshot(run) == before  # nothing moved, written or appended
    # fewer steps than the run already has: refused too
    _refused(capsys, _argv(data_dir, run, "--steps=1"), "num_train_steps: 2 -> 1 (may only grow)")
    assert _snapshot(run) == before
    # --restart: the old run's files are deleted and the new config trains from step 0
    assert cli.run(main, [*other, "--restart"]) == 0
    summary = main(other)  # and is now the workdir's run: a rerun reads it back
    assert summary["rerun"] and summary["resumed_from"] == 0 and summary["steps"] == STEPS
    assert '"seed": 3' in (run / "config.json").read_text()
    raw = read_jsonl(run / "metrics.jsonl", latest_only=False)
    # only the new run's records (log_every 10: the last step's window)
    assert [(r["split"], r["step"]) for r in raw] == [("train", 2), ("val", 2), ("test", 2)]
    assert raw[0]["loss"] == summary["train"]["loss"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]


def test_config_differences_rules():
    """Which keys may differ on resume (end to end: the multi-process test of
    tests/test_train_cli.py resumes a 2-step run to 4 steps, inside the cosine warmup)."""
    base = configs.get_config("listops", "mini")
    base.update(schedule="rsqrt", num_train_steps=100, warmup_steps=10)
    stored = guard.config_dict(base)
    c = base.copy_and_resolve_references()
    c.update(eval_every=7, log_every=3, checkpoint_every=9, max_to_keep=1, mesh_shape=(2, -1))
    c.num_train_steps = 200  # rsqrt: the learning rates of steps 0..99 stay
    assert guard.config_differences(stored, c) == []
    c.schedule = "cosine"  # its decay spans the total: steps 10..99 would change
    assert guard.config_differences(stored, c) == [
        "num_train_steps: 100 -> 200 (would change the cosine learning rate of steps run)",
        'schedule: "rsqrt" -> "cosine"',
    ]
    base.update(schedule="cosine", num_train_steps=8)  # all in the warmup: may grow
    c = base.copy_and_resolve_references()
    c.num_train_steps = 50
    assert guard.config_differences(guard.config_dict(base), c) == []
    c = base.copy_and_resolve_references()
    c.model.new_key = 1
    c.num_train_steps = 4
    assert guard.config_differences(guard.config_dict(base), c) == [
        "model.new_key: <absent> -> 1",
        "num_train_steps: 8 -> 4 (may only grow)",
    ]


def _corrupt_arrays(run: Path) -> None:
    files = [p for p in (run / "checkpoints").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files
    for p in files:
        p.write_bytes(b"\x00garbage")


def test_no_checkpoint_that_restores_is_refused_in_one_line(finished, tmp_path):
    """Every checkpoint's arrays damaged: the command exits 2 with one line and no
    traceback (neither TensorStore's nor orbax's), and moves nothing."""
    run = _copy(finished, tmp_path)
    (run / "summary.json").unlink()  # a run that stopped after its last checkpoint
    _corrupt_arrays(run)
    before = _snapshot(run)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-m", "train", *_argv(finished[0], run)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    err = proc.stderr.strip()
    assert proc.returncode == 2, err[-3000:]
    assert len(err.splitlines()) == 1, err[-3000:]
    assert err.startswith(f"error: none of the 1 checkpoints in {run / 'checkpoints'} restores")
    assert "--restart" in err and "Traceback" not in err
    assert _snapshot(run) == before and not (run / "checkpoints_corrupt").exists()


def test_checkpoints_of_another_model_without_config_json(finished, tmp_path, capsys):
    """A workdir without config.json (written by another tool) holding another model's
    checkpoints: refused from the checkpoint's metadata, naming the first array."""
    run = _copy(finished, tmp_path)
    (run / "config.json").unlink()
    (run / "summary.json").unlink()
    before = _snapshot(run)
    _refused(
        capsys,
        _argv(finished[0], run, "--set=model.mlp_dim=16"),
        "another model's arrays: params/encoder/block_0/mlp/wi/bias float32[32] stored, "
        "float32[16] here",
        "--restart",
    )
    assert _snapshot(run) == before


def _tree(x):
    return {"w": np.full((4, 3), x, np.float32), "step": np.int32(x)}


def test_checkpointer_refuses_when_none_restores(tmp_path):
    ck = ckpt_lib.Checkpointer(tmp_path, max_to_keep=5, async_save=False)
    for s in (1, 2):
        ck.save(s, _tree(s), {"step": s})
        ck.save_best(s, _tree(s), {"step": s}, {"accuracy": float(s)})
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), _tree(0)
    )
    for sub in ("checkpoints", "best"):
        for p in (tmp_path / sub).rglob("*"):
            if p.is_file():
                p.write_bytes(b"\x00garbage")
    with pytest.raises(errors.WorkdirError, match="none of the 2 checkpoints .* restores"):
        ck.restore_latest(target)
    assert sorted(ck.latest.all_steps()) == [1, 2]  # nothing moved
    with pytest.warns(RuntimeWarning, match="no checkpoint in .*best restores"):
        assert ck.restore_best(target) is None
    ck.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "checkpoints"]
    # another layout is refused from the metadata, before any array is read
    ck = ckpt_lib.Checkpointer(tmp_path / "b", async_save=False)
    ck.save(1, _tree(1), {"step": 1})
    wrong = {"w": jax.ShapeDtypeStruct((4, 4), np.float32), "step": target["step"]}
    with pytest.raises(errors.WorkdirError, match=r"w float32\[4, 3\] stored, float32\[4, 4\]"):
        ck.restore_latest(wrong)
    ck.close()


def test_finished_run_rerun_appends_nothing(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path)
    before = _snapshot(run)
    summary = main(_argv(finished[0], run))
    out = capsys.readouterr().out
    assert summary["rerun"] and summary["steps"] == STEPS
    assert "finished earlier: its stored summary (nothing trained or appended)" in out
    assert "test: accuracy" in out
    assert _snapshot(run) == before


@pytest.mark.parametrize(
    "flag, key",
    [
        ("--steps=0", "num_train_steps (--steps) must be an integer >= 1, got 0"),
        ("--steps=-5", "num_train_steps (--steps) must be an integer >= 1, got -5"),
        ("--set=checkpoint_every=0", "checkpoint_every must be an integer >= 1, got 0"),
        ("--set=eval_every=-1", "eval_every must be an integer >= 1, got -1"),
        ("--set=log_every=0", "log_every must be an integer >= 1, got 0"),
        ("--attention=bogus", "attention must be one of ['softmax', "),
    ],
)
def test_bad_settings_fail_before_the_workdir_exists(flag, key, tmp_path, capsys):
    run = tmp_path / "new"
    _refused(capsys, _argv(tmp_path / "data", run, flag), key)
    assert not run.exists()


def test_bad_settings_in_the_other_entry_points(tmp_path, capsys):
    with pytest.raises(errors.ConfigError, match=r"num_train_steps \(--steps\)"):
        lm.main(["--steps=0", f"--workdir={tmp_path / 'lm'}", "--no_progress"])
    assert not (tmp_path / "lm").exists()
    (row,) = results.main(
        ["--tasks=listops", "--attentions=bogus", f"--workdir={tmp_path / 'r'}", "--steps=1"]
    )
    assert row["error"].startswith("ConfigError: attention must be one of")
    assert "Traceback" not in capsys.readouterr().err
    assert not (tmp_path / "r" / "listops").exists()


def test_os_errors_name_the_path(finished, tmp_path, capsys):
    data_dir = finished[0]
    afile = tmp_path / "afile"
    afile.write_text("x")
    _refused(capsys, _argv(data_dir, afile), f"workdir {afile} exists and is not a directory")
    _refused(capsys, _argv(data_dir, afile / "sub"), f"Not a directory: '{afile / 'sub'}'")
    assert afile.read_text() == "x"
    if Path("/dev/full").exists():  # a full disk: the summary's write fails (a run that
        full = _copy(finished, tmp_path)  # stopped after its last checkpoint: no training)
        (full / "summary.json").unlink()
        (full / "summary.json").symlink_to("/dev/full")
        _refused(capsys, _argv(data_dir, full), f"No space left on device: '{full}'")


def test_read_only_workdir_names_the_path(finished, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        undo = ["chmod", "755", str(ro)]
    else:  # root writes anywhere: make the directory immutable instead
        if subprocess.run(["chattr", "+i", str(ro)], capture_output=True).returncode:
            pytest.skip("root without chattr +i: no read-only directory to test")
        undo = ["chattr", "-i", str(ro)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _refused(capsys, _argv(finished[0], ro), str(ro))
    finally:
        subprocess.run(undo, check=True)
    assert list(ro.iterdir()) == []
