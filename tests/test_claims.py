"""train.claims: the cache, the report, the CLI, and the pieces the claims are built from."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from train import claims
from train.claims import __main__ as claims_cli
from train.claims import laplacian, table


@pytest.fixture
def toy_claim(monkeypatch):
    """A registered cheap claim that counts its runs."""
    calls = []

    def fn(settings):
        calls.append(settings)
        return claims.Finding("x = 1", claims.PARTLY, "because", {"x": 1})

    registry = {**claims.all_claims()}
    monkeypatch.setattr(claims, "CLAIMS", registry)
    claims.claim("toy.claim", paper="RA / LARA", statement="A toy.", experiment="None.")(fn)
    return calls


def test_run_caches_and_report_merges(tmp_path, toy_claim):
    settings = claims.Settings(seeds=2, workdir=tmp_path / "runs", findings=tmp_path)
    (record,) = claims.run(claims.select(["toy.claim"]), settings, log=lambda *_: None).values()
    assert record["finding"]["verdict"] == claims.PARTLY and len(toy_claim) == 1
    cached = json.loads((tmp_path / "toy.claim.json").read_text())
    assert cached["settings"] == {"seeds": 2, "quick": False}
    claims.run(claims.select(["toy.claim"]), settings, log=lambda *_: None)
    assert len(toy_claim) == 1  # reused from the cache
    claims.run(claims.select(["toy.claim"]), settings, rerun=True, log=lambda *_: None)
    assert len(toy_claim) == 2
    # other settings do not reuse it
    assert claims.load(claims.Settings(seeds=3, findings=tmp_path), "toy.claim") is None
    assert not (tmp_path / "runs").exists()  # findings apart from the training runs
    text = claims.report(settings)
    assert f"kept in `{tmp_path}/<key>.json`" in text
    assert "| A toy. | None. | x = 1 | **partly** |" in text
    assert "not run yet: `python -m train.claims --only ra.unbiased`" in text
    assert "**`toy.claim`**" in text and "because" in text
    # `tasks` (the table's) concerns only training claims: a cheap finding is reused under
    # it; a training finding made on some tasks is shown by every report, naming them.
    with_tasks = dataclasses.replace(settings, tasks=("pathfinder",))
    claims.run(claims.select(["toy.claim"]), with_tasks, log=lambda *_: None)
    assert len(toy_claim) == 2
    claims.claim("toy.train", paper="RA / LARA", statement="T.", experiment="E.", kind="train")(
        lambda settings: claims.Finding("y = 2", claims.PARTLY, "table")
    )
    claims.run(claims.select(["toy.train"]), with_tasks, log=lambda *_: None)
    assert claims.load(settings, "toy.train", "train") is None  # not reused for all tasks
    assert "table tasks: pathfinder" in claims.report(settings)


def test_select_and_finding_errors():
    with pytest.raises(KeyError, match=r"unknown claim\(s\) \['nope'\]"):
        claims.select(["nope"])
    with pytest.raises(ValueError, match="kind must be"):
        claims.select(None, "slow")
    with pytest.raises(ValueError, match="verdict must be one of"):
        claims.Finding("", "maybe", "")
    assert {c.kind for c in claims.select(None, "cheap")} == {"cheap"}
    keys = set(claims.all_claims())
    # every paper's claims named by the issue are registered
    for key in ("flexformer.init_rate", "laplacian.newton_schulz_vs_cg", "ra.unbiased",
                "lara.error_vs_samples", "table.equal_budget"):  # fmt: skip
        assert key in keys


def test_cli_list_and_report_only(tmp_path, capsys, toy_claim):
    claims_cli.main(["--list", "--kind", "cheap"])
    out = capsys.readouterr().out
    assert "ra.unbiased" in out and "table.equal_budget" not in out
    report = tmp_path / "claims.md"
    claims_cli.main(["--report-only", "--findings", str(tmp_path), "--out", str(report)])
    assert report.read_text().startswith("# The seeds' claims")
    # --quick keeps its findings under the workdir, never in the tracked docs/claims
    claims_cli.main(["--only", "toy.claim", "--quick", "--workdir", str(tmp_path), "--out", ""])
    assert (tmp_path / "quick_findings" / "toy.claim.json").exists() and len(toy_claim) == 1
    assert toy_claim[0].findings == tmp_path / "quick_findings"
    assert claims_cli.main(["--only", "toy.claim", "--findings", str(tmp_path), "--out", ""])
    assert (tmp_path / "toy.claim.json").exists() and len(toy_claim) == 2
    with pytest.raises(SystemExit):
        claims_cli.main(["--seeds", "0"])


def test_conjugate_gradient_and_newton_schulz_invert_a_laplace_matrix():
    x = jax.random.normal(jax.random.key(0), (8, 4))
    a = laplacian.laplace_matrix(x, 2.0)
    assert np.all(np.linalg.eigvalsh(np.asarray(a, np.float64)) > 0)  # positive definite
    want = np.linalg.inv(np.asarray(a, np.float64))
    cg = laplacian.conjugate_gradient_inverse(a, 8)  # exact after m steps (to rounding)
    ns = kernels.newton_schulz_inverse(a[None, None], iters=30, eps=0.0, impl="xla")[0, 0]
    for got in (cg, ns):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
    assert float(jnp.max(jnp.abs(laplacian.conjugate_gradient_inverse(a, 1) - want))) > 1e-2


def test_table_config_applies_the_budget():
    c = table.task_config("listops", "performer", seed=2)
    assert (c.data.min_length, c.data.max_length, c.data.seq_len) == (100, 250, 256)
    assert c.seed == 2 and c.num_train_steps == 500 and c.attention == "performer"
    assert table.task_config("listops", "softmax", 0, quick=True).num_train_steps == 4


def _fake_runs(root, accs, steps=4):
    """Finished table runs (summary.json only) with the given test accuracies."""
    for (task, name, seed), acc in accs.items():
        run = root / "runs" / task / name / f"seed{seed}"
        run.mkdir(parents=True)
        summary = {"steps": steps, "test": {"accuracy": acc}, "wall_seconds": 600.0}
        (run / "summary.json").write_text(json.dumps(summary))


def test_table_claims_read_finished_runs_and_skip_unlearned_tasks(tmp_path, monkeypatch):
    monkeypatch.setattr(
        table, "TASKS", {"listops": table.TASKS["listops"], "pathfinder": ("mini", {})}
    )
    accs = {}
    for seed, jitter in enumerate((0.0, 0.01)):
        accs |= {
            ("listops", "softmax", seed): 0.40 + jitter,
            ("listops", "laplacian", seed): 0.38 + jitter,
            ("listops", "soft", seed): 0.30 + jitter,
            ("pathfinder", "softmax", seed): 0.50 + jitter,  # chance: not testable
            ("pathfinder", "laplacian", seed): 0.52,
            ("pathfinder", "soft", seed): 0.50,
        }
    _fake_runs(tmp_path, accs)
    settings = claims.Settings(seeds=2, quick=True, workdir=tmp_path, findings=tmp_path / "f")
    monkeypatch.setattr(table, "MECHANISMS", ("softmax", "laplacian", "soft"))
    got = table.run_table(settings)  # reads the summaries, trains nothing
    assert got["listops"]["laplacian"] == [0.38, 0.39]
    finding = table.laplacian_beats_soft(settings)
    assert finding.verdict == claims.REPRODUCED and finding.data["wins"] == {"listops": True}
    assert "pathfinder: skipped" in finding.numbers
    assert table.equal_budget(settings).verdict == claims.PARTLY  # softmax learns 1 of 2


def test_table_claims_on_a_subset_of_the_tasks(tmp_path, monkeypatch):
    """`Settings.tasks` reports the table one task at a time: only those runs are read (the
    others would be trained), the rest is listed as not run, and the cache key says which."""
    monkeypatch.setattr(table, "MECHANISMS", ("softmax", "laplacian", "soft"))
    accs = {("pathfinder", n, s): a for s in range(2) for n, a in
            (("softmax", 0.7 + s / 100), ("laplacian", 0.55), ("soft", 0.5))}  # fmt: skip
    _fake_runs(
        tmp_path, accs, steps=int(table.task_config("pathfinder", "soft", 0, True).num_train_steps)
    )
    settings = claims.Settings(
        seeds=2, quick=True, workdir=tmp_path, findings=tmp_path / "f", tasks=("pathfinder",)
    )
    assert list(table.run_table(settings)) == ["pathfinder"]
    finding = table.laplacian_beats_soft(settings)
    assert finding.data["wins"] == {"pathfinder": True}
    assert "listops: not run yet" in finding.numbers
    found = table.equal_budget(settings)
    assert "not run yet: listops" in found.numbers
    assert sum(found.data["train_runs"].values()) == 6 * 600.0
    assert "took 1.0 h of wall time" in found.why
    png = tmp_path / "f" / found.data["plot"]  # the table's bars, beside the findings
    assert png.read_bytes()[:4] == b"\x89PNG"
    claims.run(claims.select(["table.equal_budget"]), settings, log=lambda *_: None)
    text = claims.report(settings)
    assert "![table.equal_budget](f/table.equal_budget.png)" in text
    # the table itself, a row per mechanism, the best in bold, each seed's value
    assert "| softmax | **70.5 +- 0.5** (70.0 / 71.0) |" in text
    assert "| soft | 50.0 +- 0.0 (50.0 / 50.0) |" in text
    minutes = float(re.search(r"([\d.]+) min of compute", text).group(1))
    assert 60.0 <= minutes < 61.0  # the runs' hour counted, beside the claim's own seconds
    assert settings.key()["tasks"] == ["pathfinder"] and "tasks" not in claims.Settings().key()
    with pytest.raises(ValueError, match="tasks"):
        table.run_table(claims.Settings(tasks=("text",)))


def test_grade():
    assert claims.grade(True, True) == claims.REPRODUCED
    assert claims.grade(True, False) == claims.PARTLY
    assert claims.grade(False, False) == claims.NOT_REPRODUCED


def test_compute_counts_a_shared_run_once_and_each_claims_time_beyond_its_runs():
    def record(seconds, runs=None):
        return {"seconds": seconds, "finding": {"data": {"train_runs": runs} if runs else None}}

    records = [
        record(5.0),  # a cheap claim: its own time
        record(2.0, {"a": 100.0, "b": 50.0}),  # read its runs from the cache: they count
        record(130.0, {"a": 100.0, "c": 20.0}),  # trained c itself (10 s beyond); a again
    ]
    assert claims.compute_seconds(records) == 5.0 + 0.0 + 10.0 + 100.0 + 50.0 + 20.0


def test_distillation_verdict_and_runs_from_the_summaries(tmp_path, monkeypatch):
    """The distillation claim reads its verdict off the runs' summaries (faked here) and
    names each run with its wall time, for the report's compute total."""
    from train.claims import distillation

    test_acc = {"flexformer_n": 0.40, "performer": 0.30, "rfa": 0.31}

    def fake_run(settings, student, seed, stage2=True):
        acc = test_acc[student] + seed / 1000
        return {"recovery": 0.95, "stage2": {"test": {"accuracy": acc}}, "wall_seconds": 60.0}

    monkeypatch.setattr(distillation, "distill_run", fake_run)
    settings = claims.Settings(seeds=3, workdir=tmp_path, findings=tmp_path / "f")
    teacher = tmp_path / "distill" / "listops" / "teacher" / "seed0"
    teacher.mkdir(parents=True)
    (teacher / "summary.json").write_text(json.dumps({"wall_seconds": 30.0}))
    found = distillation.distillation(settings)
    assert found.verdict == claims.REPRODUCED  # recovers, and above both by > 2 stds
    runs = found.data["train_runs"]  # 9 students and 3 teachers (two not trained: 0 s)
    assert len(runs) == 12 and "distill/listops/rfa/seed2" in runs
    assert runs["distill/listops/teacher/seed0"] == 30.0
    assert sum(runs.values()) == 9 * 60.0 + 30.0


def test_frequency_growth_reads_the_trained_frequencies(tmp_path):
    """flexformer_n's frequency scale after a (quick) table run over its init: read from the
    run's checkpoint (so not 1 exactly: the frequencies moved), None without one."""
    from train import loop

    settings = claims.Settings(seeds=1, quick=True, workdir=tmp_path, findings=tmp_path / "f")
    assert table.frequency_growth(settings, "listops") is None
    config = table.task_config("listops", "flexformer_n", 0, quick=True)
    config.learning_rate = 0.1  # 4 steps (in warm-up) that move the frequencies a little
    loop.train_and_evaluate(config, table._run_dir(settings, "listops", "flexformer_n", 0))
    growth = table.frequency_growth(settings, "listops")
    assert 0.5 < growth < 2.0 and abs(growth - 1.0) > 1e-5, growth  # measured 0.99983
