"""train.claims: the cache, the report, the CLI, and the pieces the claims are built from."""

import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from train import claims
from train.claims import __main__ as claims_cli
from train.claims import cache as run_cache
from train.claims import laplacian, stats, table


@pytest.fixture
def toy_claim(monkeypatch):
    """A registered cheap claim that counts its runs."""
    calls = []

    def fn(settings):
        calls.append(settings)
        return claims.Finding("x = 1", claims.PARTLY, "because", {"x": 1})

    registry = {**claims.all_claims()}
    monkeypatch.setattr(claims, "CLAIMS", registry)
    claims.claim("toy.claim", paper="RA / LARA", statement="A toy.", experiment="None.", rule="R.")(
        fn
    )
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
    assert "| A toy. | None. | R. | x = 1 | **partly** |" in text  # the rule before the numbers
    assert "pending: `python -m train.claims --only ra.unbiased`" in text
    assert "**`toy.claim`**" in text and "because" in text
    # `tasks` (the table's) concerns only training claims: a cheap finding is reused under
    # it; a training finding made on some tasks is shown by every report, naming them.
    with_tasks = dataclasses.replace(settings, tasks=("pathfinder",))
    claims.run(claims.select(["toy.claim"]), with_tasks, log=lambda *_: None)
    assert len(toy_claim) == 2
    claims.claim(
        "toy.train", paper="RA / LARA", statement="T.", experiment="E.", kind="train", rule="R."
    )(lambda settings: claims.Finding("y = 2", claims.PARTLY, "table"))
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
    # every claim the papers make that the report tests is registered
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
    # --quick keeps its findings and its report under the workdir, never in the tracked docs
    claims_cli.main(["--only", "toy.claim", "--quick", "--workdir", str(tmp_path)])
    assert (tmp_path / "quick_findings" / "toy.claim.json").exists() and len(toy_claim) == 1
    assert (tmp_path / "quick_claims.md").read_text().startswith("# The seeds' claims")
    assert toy_claim[0].findings == tmp_path / "quick_findings"
    assert toy_claim[0].seeds == claims.MIN_SEEDS == 5  # the power settings are the default
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


def test_table_config_applies_the_budget_and_the_power_settings():
    c = table.task_config("listops", "performer", seed=2)
    assert (c.data.min_length, c.data.max_length, c.data.seq_len) == (100, 250, 256)
    assert c.seed == 2 and c.num_train_steps == 500 and c.attention == "performer"
    assert table.task_config("listops", "softmax", 0, quick=True).num_train_steps == 4
    # the power settings: >= 5 seeds, test sets >= 2000, the larger Pathfinder budget
    assert claims.Settings().seeds >= 5 == claims.MIN_SEEDS
    for task in table.TASKS:
        assert table.task_config(task, "softmax", 0).data.num_test >= 2000
    p = table.task_config("pathfinder", "lara_mixed", 0)
    assert (p.data.num_train, p.num_train_steps) == (100_000, 5000)
    assert p.attention == "lara" and p.attention_config.mixed is True
    # flexformer_n's kernel variants: one option each, top-level (the lr multiplier) or
    # the mechanism's
    lr10, raw = (table.task_config("listops", f"flexformer_n_{v}", 0) for v in ("lr10", "raw"))
    assert (lr10.attention, lr10.mechanism_lr_mult, lr10.attention_config.num_features) == (
        "flexformer_n", 10.0, 32)  # fmt: skip
    assert raw.mechanism_lr_mult == 1.0 and raw.attention_config.qk_radius is None
    assert table.budget(table.task_config("listops", "flexformer_n_f128", 0)) == "128 features"
    # the attention budget beside each row: lara's proposals capped at Pathfinder's 36 tokens
    assert table.budget(table.task_config("pathfinder", "lara", 0)) == "36 proposals x 1 sample(s)"
    assert table.budget(table.task_config("listops", "performer", 0)) == "64 features"
    assert table.budget(table.task_config("pathfinder", "laplacian", 0)) == "16 landmarks"
    with pytest.raises(ValueError, match="arm must be one of"):
        table.task_config("listops", "nope", 0)


def _fake_runs(root, accs, quick=True):
    """Finished table runs (run key and summary.json only) with the given test accuracies."""
    settings = claims.Settings(quick=quick, workdir=root)
    for (task, name, seed), acc in accs.items():
        config = table.task_config(task, name, seed, quick)
        run = table.table_dir(settings, task, name, seed)
        run_cache.prepare(run, run_cache.run_key(config), log=lambda *_: None)
        summary = {"steps": int(config.num_train_steps), "test": {"accuracy": acc},
                   "wall_seconds": 600.0}  # fmt: skip
        (run / "summary.json").write_text(json.dumps(summary))


def _no_training(monkeypatch):
    def fail(config, workdir):
        raise AssertionError(f"trained {workdir}")

    from train import loop

    monkeypatch.setattr(loop, "train_and_evaluate", fail)


def test_table_claims_decide_by_interval_and_skip_unlearned_tasks(tmp_path, monkeypatch):
    _no_training(monkeypatch)
    monkeypatch.setattr(
        table, "MECHANISMS", ("softmax", *table.LINEAR, "laplacian", "lara", "flexformer_n")
    )
    jitter = (0.0, 0.01, -0.01, 0.02, -0.02)
    accs = {}
    for s, j in enumerate(jitter):
        accs |= {
            ("listops", "softmax", s): 0.40 + j,
            ("listops", "performer", s): (0.20, 0.21, 0.19, 0.22, 0.18)[s],
            ("listops", "rfa", s): 0.20 + j,
            ("listops", "hedgehog", s): 0.22 + j,
            ("listops", "lara", s): 0.30 + j,  # clearly above performer
            ("listops", "flexformer_n", s): 0.25 + j,  # 3-5 points above every linear one
            ("listops", "laplacian", s): (0.19, 0.23, 0.20, 0.22, 0.21)[s],  # within noise
            ("listops", "laplacian_gaussian", s): 0.15 + j,  # the kernel ablation: below
            ("pathfinder", "softmax", s): 0.75 if s else 0.60,  # one seed below 70%: gated
        }
    _fake_runs(tmp_path, accs)
    settings = claims.Settings(seeds=5, quick=True, workdir=tmp_path, findings=tmp_path / "f")
    got = table.run_table(settings)  # reads the summaries; pathfinder's others not trained
    assert got["listops"]["lara"] == pytest.approx([0.30 + j for j in jitter])
    assert list(got["pathfinder"]) == ["softmax"]
    assert table.softmax_learns(got, "listops") == (True, "learned")
    assert not table.softmax_learns(got, "pathfinder")[0]
    finding = table.lara_trains_better(settings)
    assert finding.verdict == claims.REPRODUCED, finding.numbers
    assert finding.data["per"] == {"listops|performer": claims.REPRODUCED}
    assert "pathfinder: not testable (softmax below 70% on a seed" in finding.numbers
    numbers, verdict, _ = table.compare(got, "laplacian", ["performer"])
    assert verdict == claims.INCONCLUSIVE, numbers  # in the claimed direction, within noise
    numbers, verdict, _ = table.compare(got, "performer", ["lara"])
    assert verdict == claims.NOT_REPRODUCED, numbers
    assert table.equal_budget(settings).verdict == claims.PARTLY  # softmax learns 1 of 2
    # the kernel ablation: laplacian(kernel="gaussian") exists, so it is decided
    assert table.gaussian_option() == ""
    finding = table.laplacian_beats_soft(settings)
    assert finding.verdict == claims.REPRODUCED, finding.numbers
    assert finding.data["per"] == {"listops|laplacian_gaussian": claims.REPRODUCED}
    assert table.task_config("listops", "laplacian_gaussian", 0).attention_config.kernel == (
        "gaussian"
    )
    # flexformer_n against each linear baseline on the tasks softmax learns (listops only)
    finding = table.flexformer_beats_linear(settings)
    assert finding.verdict == claims.REPRODUCED, finding.numbers
    assert finding.data["per"] == dict.fromkeys(table.LINEAR, claims.REPRODUCED)
    assert "LRA average over listops (5 seeds)" in finding.numbers
    assert finding.data["frequency_growth"] == {"listops": None}  # no checkpoint: None


def test_table_claims_on_a_subset_of_the_tasks(tmp_path, monkeypatch):
    """`Settings.tasks` reports the table one task at a time: only those runs are read, the
    rest is listed as not run, and the cache key says which."""
    _no_training(monkeypatch)
    monkeypatch.setattr(table, "MECHANISMS", ("softmax", "laplacian", "soft"))
    accs = {("pathfinder", n, s): a for s in range(2) for n, a in
            (("softmax", 0.7 + s / 100), ("laplacian", 0.55), ("soft", 0.5))}  # fmt: skip
    _fake_runs(tmp_path, accs)
    settings = claims.Settings(
        seeds=2, quick=True, workdir=tmp_path, findings=tmp_path / "f", tasks=("pathfinder",)
    )
    assert list(table.run_table(settings)) == ["pathfinder"]
    found = table.equal_budget(settings)
    assert "not run yet: listops" in found.numbers
    assert sum(found.data["train_runs"].values()) == 6 * 600.0
    assert "took 1.0 h of wall time" in found.why
    png = tmp_path / "f" / found.data["plot"]  # the table's bars, beside the findings
    assert png.read_bytes()[:4] == b"\x89PNG"
    claims.run(claims.select(["table.equal_budget"]), settings, log=lambda *_: None)
    text = claims.report(settings)
    assert "![table.equal_budget](f/table.equal_budget.png)" in text
    # the table itself, a row per arm, the best in bold, each seed's value and the budget
    assert "| softmax | **70.5 +- 0.7** (70.0 / 71.0; exact (quadratic)) |" in text
    assert "| soft | 50.0 +- 0.0 (50.0 / 50.0; 16 landmarks) |" in text
    minutes = float(re.search(r"([\d.]+) min of compute", text).group(1))
    assert 60.0 <= minutes < 61.0  # the runs' hour counted, beside the claim's own seconds
    assert settings.key()["tasks"] == ["pathfinder"] and "tasks" not in claims.Settings().key()
    with pytest.raises(ValueError, match="tasks"):
        table.run_table(claims.Settings(tasks=("text",)))


def test_ablation_claims_name_only_their_own_tasks_as_not_run(tmp_path, monkeypatch):
    """LARA's ablations run on ListOps alone (`ablations.ABLATION_TASKS`): Pathfinder is not
    one of their tasks, so it is not reported as pending."""
    from train.claims import ablations

    _no_training(monkeypatch)
    accs = {("listops", n, s): a + s / 100 for s in range(2)
            for n, a in (("softmax", 0.34), ("lara", 0.33), ("lara_bh", 0.32))}  # fmt: skip
    _fake_runs(tmp_path, accs)
    settings = claims.Settings(seeds=2, quick=True, workdir=tmp_path, findings=tmp_path / "f")
    found = ablations.lara_decoupled_weights(settings)
    assert found.numbers.startswith("listops: lara 33.5 +- 0.7 vs lara_bh 32.5 +- 0.7")
    assert "not run" not in found.numbers
    assert sum(found.data["train_runs"].values()) == 6 * 600.0  # the compute counts its runs
    # the same comparison over every task still names the missing one
    listops = table.run_table(settings, ("softmax", "lara", "lara_bh"), ("listops",))
    numbers, _, _ = table.compare(listops, "lara", ["lara_bh"])
    assert numbers.endswith("; pathfinder: not run yet")


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
    config = distillation._teacher_config(settings, "listops", 0)
    run_cache.prepare(teacher, run_cache.run_key(config))  # the teacher's own key
    (teacher / "summary.json").write_text(json.dumps({"wall_seconds": 30.0}))
    found = distillation.distillation(settings)
    assert found.verdict == claims.REPRODUCED  # recovers, and above both by > 2 stds
    runs = found.data["train_runs"]  # 9 students and 3 teachers (two not trained: 0 s)
    assert len(runs) == 12 and "distill/listops/rfa/seed2" in runs
    assert runs["distill/listops/teacher/seed0"] == 30.0
    assert sum(runs.values()) == 9 * 60.0 + 30.0


def test_frequency_growth_reads_the_trained_frequencies(tmp_path, monkeypatch):
    """flexformer_n's frequency scale after a (quick) table run over its init: read from the
    run's checkpoint (so not 1 exactly: the frequencies moved), None without one. The run
    writes its checkpoint only: no kernel diagnostics, plots or TensorBoard (their own tests
    are in test_kernel_diagnostics and test_train; without them the test alone: 21 s -> 14 s)."""
    from train import kernel_diagnostics, loop

    monkeypatch.setattr(kernel_diagnostics, "for_run", lambda *a, **k: None)

    settings = claims.Settings(seeds=1, quick=True, workdir=tmp_path, findings=tmp_path / "f")
    assert table.frequency_growth(settings, "listops") is None
    config = table.task_config("listops", "flexformer_n", 0, quick=True)
    config.learning_rate = 0.1  # 4 steps (in warm-up) that move the frequencies a little
    config.mesh_shape = (1, 1)  # on one device
    config.update(plot=False, tensorboard=False, compile_memory_analysis=False)
    loop.train_and_evaluate(config, table.table_dir(settings, "listops", "flexformer_n", 0))
    growth = table.frequency_growth(settings, "listops")
    assert 0.5 < growth < 2.0 and abs(growth - 1.0) > 1e-5, growth  # measured 0.99983


def test_interval_matches_the_t_formulas():
    # b constant: Welch's df is len(a) - 1 = 2, t(0.975, 2) = 4.3027, sample std of a = 1
    diff, lo, hi = stats.interval([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    assert diff == 2.0 and hi - diff == pytest.approx(4.3027 / np.sqrt(3), rel=1e-4)
    assert diff - lo == pytest.approx(hi - diff)
    # paired: the differences 1, 2, 3 give the same interval as above
    assert stats.interval([1.0, 2.0, 3.0], [0.0, 0.0, 0.0], "paired") == pytest.approx(
        (diff, lo, hi)
    )
    boot = stats.interval([1.0, 2.0, 3.0, 2.0], [0.0, 0.5, 0.0, 0.5], "bootstrap")
    assert boot[1] < boot[0] < boot[2] and boot[1] > 0
    with pytest.raises(ValueError, match="need >= 2"):
        stats.interval([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="test must be"):
        stats.interval([1.0, 2.0], [1.0, 2.0], "z")


def test_verdicts_from_the_interval():
    win = stats.Rule("greater", margin=0.01)
    noise = [0.50, 0.46, 0.54, 0.49, 0.51]
    assert win.decide([x + 0.10 for x in noise], noise)[0] == claims.REPRODUCED  # clear win
    assert win.decide([x - 0.10 for x in noise], noise)[0] == claims.NOT_REPRODUCED  # a loss
    assert win.decide([x + 0.02 for x in noise[::-1]], noise)[0] == claims.INCONCLUSIVE
    tight = [0.500, 0.501, 0.499, 0.500, 0.500]  # level, tightly: a 1-point win is excluded
    assert win.decide(tight, tight[::-1])[0] == claims.NOT_REPRODUCED
    assert win.decide([0.6], noise)[0] == claims.INCONCLUSIVE  # one seed: no interval
    lower = stats.Rule("less", margin=0.01)
    assert lower.decide(noise, [x + 0.10 for x in noise])[0] == claims.REPRODUCED
    same = stats.Rule("equivalent", margin=0.02)
    assert same.decide(tight, tight[::-1])[0] == claims.REPRODUCED
    assert same.decide([x + 0.10 for x in tight], tight)[0] == claims.NOT_REPRODUCED
    assert same.decide(noise, tight)[0] == claims.INCONCLUSIVE
    assert stats.decide("greater", -0.5, 0.5, 0.0) == claims.INCONCLUSIVE
    verdict, st = win.decide([x + 0.10 for x in noise], noise)
    assert win.summary(st).startswith("+10.0 [")
    assert "wholly > 0" in win.text("x", "y") and "ddof = 1" in win.text()
    for bad in (dict(direction="up"), dict(direction="greater", test="z"),
                dict(direction="equivalent"), dict(direction="less", margin=-1)):  # fmt: skip
        with pytest.raises(ValueError, match="Rule"):
            stats.Rule(**bad)
    with pytest.raises(ValueError, match="lo <= hi"):
        stats.decide("greater", 1.0, 0.0)


def test_combine():
    r, p, n, i, t = (claims.REPRODUCED, claims.PARTLY, claims.NOT_REPRODUCED,
                     claims.INCONCLUSIVE, claims.NOT_TESTABLE)  # fmt: skip
    assert stats.combine([r, r, t]) == r
    assert stats.combine([n, n]) == n
    assert stats.combine([r, n]) == stats.combine([r, i]) == stats.combine([p, n]) == p
    assert stats.combine([i, n]) == i
    assert stats.combine([t, t]) == stats.combine([]) == t
    with pytest.raises(ValueError, match="combine"):
        stats.combine(["maybe"])


def test_code_version_keys_the_mechanism_and_training_sources(tmp_path):
    tree = {
        "linattn_jax/__init__.py": "from linattn_jax import a, b, c, shared\n",
        "linattn_jax/shared.py": "from . import b\n",  # a mechanism-specific table: dead end
        "linattn_jax/a.py": "from linattn_jax import helper_a\n",
        "linattn_jax/helper_a.py": "x = 1\n",
        "linattn_jax/b.py": "from linattn_jax.a import f\n",  # b runs a (flexformer: performer)
        "linattn_jax/c.py": "x = 1\n",
        "kernels/k.py": "x = 1\n",  # reached by nothing: hashed for every run
        "kernels/bench.py": "x = 1\n",  # the kernels' benchmark: excluded
        "train/loop.py": "import linattn_jax\n",
        "train/claims/c.py": "x = 1\n",
        "train/bench/d.py": "x = 1\n",
    }
    for rel, text in tree.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    every = tuple(f"linattn_jax.{m}" for m in "abc")

    def versions():
        run_cache.code_version.cache_clear()
        v = {m: run_cache.code_version(tmp_path, (f"linattn_jax.{m}",), every) for m in "abc"}
        return {**v, "all": run_cache.code_version(tmp_path)}

    assert run_cache.private_files(tmp_path, ("linattn_jax.c",), every) == {
        "linattn_jax/a.py", "linattn_jax/helper_a.py", "linattn_jax/b.py"}  # fmt: skip
    v0 = versions()
    assert len(set(v0.values())) == 4
    for rel, moved in [("train/claims/c.py", ""), ("train/bench/d.py", ""),  # the report's code
                       ("kernels/bench.py", ""),
                       ("linattn_jax/helper_a.py", "ab"), ("linattn_jax/b.py", "b"),
                       ("linattn_jax/c.py", "c"), ("linattn_jax/shared.py", "abc"),
                       ("kernels/k.py", "abc"), ("train/loop.py", "abc")]:  # fmt: skip
        (tmp_path / rel).write_text((tmp_path / rel).read_text() + "y = 2\n")
        v1 = versions()
        assert {m for m in "abc" if v1[m] != v0[m]} == set(moved), rel
        assert (v1["all"] != v0["all"]) == bool(moved), rel
        v0 = v1
    run_cache.code_version.cache_clear()
    # the real registry: a run's key names its own mechanism's code
    keys = {n: run_cache.run_key(table.task_config("listops", n, 0, quick=True))["code"]
            for n in ("softmax", "performer", "flexformer_n", "flexformer_s")}  # fmt: skip
    assert keys["flexformer_n"] == keys["flexformer_s"] != keys["performer"] != keys["softmax"]


def test_run_cache_reruns_stale_runs_and_keeps_fresh_ones(tmp_path):
    config = table.task_config("listops", "softmax", 0, quick=True)
    key = run_cache.run_key(config)
    other = dict(key, config=run_cache.config_digest(table.task_config("listops", "rfa", 0)))
    run = tmp_path / "run"
    assert run_cache.prepare(run, key, log=lambda *_: None) is False
    (run / "summary.json").write_text(json.dumps({"steps": 4, "test": {"accuracy": 0.5}}))
    (run / "checkpoint").write_text("resumable")
    assert run_cache.finished(run, key, 4)["test"]["accuracy"] == 0.5
    assert run_cache.finished(run, key, 8) is None  # not finished: resumed, not moved
    assert run_cache.finished(run, other, 4) is None
    assert run_cache.prepare(run, key, log=lambda *_: None) is False
    assert (run / "checkpoint").exists()  # same key: kept (train_and_evaluate resumes)
    assert run_cache.prepare(run, other, log=lambda *_: None) is True  # config changed
    assert not (run / "checkpoint").exists() and (tmp_path / "run.stale" / "checkpoint").exists()
    assert run_cache.read_key(run) == other
    # the digest ignores the progress bar, not the budget
    c2 = table.task_config("listops", "softmax", 0, quick=True)
    c2.progress_bar = True
    assert run_cache.config_digest(c2) == key["config"]
    c2.num_train_steps = 5
    assert run_cache.config_digest(c2) != key["config"]


def test_ledger_keeps_finished_runs_for_a_fresh_workdir(tmp_path, monkeypatch):
    from train.claims import distillation, runs

    _no_training(monkeypatch)
    first = claims.Settings(workdir=tmp_path / "a", findings=tmp_path / "f")
    fresh = claims.Settings(workdir=tmp_path / "b", findings=tmp_path / "f")  # a new clone
    assert claims.Settings(quick=True, workdir=tmp_path).kept(tmp_path / "x") is None
    _fake_runs(tmp_path / "a", {("listops", "rfa", 0): 0.3}, quick=False)
    run = runs.Run("listops", "rfa", 0)
    path = table.table_dir(first, *run)
    copy = first.kept(path)
    assert copy == tmp_path / "f" / "ledger" / path.relative_to(tmp_path / "a")
    assert not copy.exists() and runs.state(fresh, run) == ("pending", None)
    assert runs.state(first, run)[0] == "finished"  # read in the workdir: kept on the way
    assert runs.state(fresh, run)[1]["test"]["accuracy"] == 0.3  # read in the ledger
    assert table.train_run(fresh, *run)["test"]["accuracy"] == 0.3  # not trained
    # a copy is read under its key only; one of another key is replaced, not mixed
    (copy / run_cache.RUN_KEY).write_text(json.dumps({"config": "another"}))
    assert runs.state(fresh, run) == ("pending", None)
    (copy / "other.json").write_text("{}")
    run_cache.keep(path, copy, overwrite=False)
    assert run_cache.read_key(copy) == run_cache.read_key(path)
    assert not (copy / "other.json").exists()
    (path / "summary.json").write_text(json.dumps({"test": {"accuracy": 0.5}}))
    run_cache.keep(path, copy, overwrite=False)  # same key, a summary there: left alone
    assert json.loads((copy / "summary.json").read_text())["test"]["accuracy"] == 0.3
    run_cache.keep(path, copy)
    assert json.loads((copy / "summary.json").read_text())["test"]["accuracy"] == 0.5
    run_cache.keep(tmp_path / "none", copy)  # no finished run there: nothing changes
    assert run_cache.read_key(copy) == run_cache.read_key(path)
    # a distillation is kept with its stage 2 and read from the ledger by a fresh clone
    d = runs.Run("distill", "rfa", 0)
    key, path, name = distillation.queued_run(first, *d)
    run_cache.prepare(path, key, log=lambda *_: None)
    done = {"recovery": 0.9, "stage2": {"test": {"accuracy": 0.375}}}
    (path / name).write_text(json.dumps(done))
    assert runs.state(first, d) == ("finished", done) == runs.state(fresh, d)


def test_ledger_distillation_reads_its_teacher_and_maps_from_files_it_needs(tmp_path, monkeypatch):
    """A fresh clone reads finished distillations, transfers and teachers from the ledger;
    a transfer still to train retrains the teacher and stage 1 whose files it reads (the
    ledger keeps summaries, not checkpoints); a stage 1 alone is not kept as a distillation."""
    from train import loop
    from train.claims import distillation

    trained = []

    def fake(name, summary):
        def run(*args, workdir, **kw):
            trained.append((name, Path(workdir).relative_to(tmp_path).parts[0]))
            out = dict(summary, **({"stage2": {}} if kw.get("stage2") else {}))
            (Path(workdir) / f"{name}_summary.json").write_text(json.dumps(out))
            return out

        return run

    def teacher(config, workdir):
        trained.append(("teacher", Path(workdir).relative_to(tmp_path).parts[0]))
        summary = {"steps": int(config.num_train_steps), "test": {"accuracy": 0.6}}
        (Path(workdir) / "summary.json").write_text(json.dumps(summary))
        return summary

    monkeypatch.setattr(loop, "train_and_evaluate", teacher)
    monkeypatch.setattr(distillation.stages, "distill", fake("distill", {"recovery": 0.9}))
    monkeypatch.setattr(distillation.stages, "kernel_transfer", fake("transfer", {"drop": 0.1}))

    def clone(name):
        return claims.Settings(seeds=1, workdir=tmp_path / name, findings=tmp_path / "f")

    assert distillation.transfer_run(clone("a"), "hedgehog", 0)["transfer"]["drop"] == 0.1
    assert trained == [("teacher", "a"), ("distill", "a"), ("teacher", "a"), ("transfer", "a")]
    ledger = tmp_path / "f" / "ledger"
    assert not list(ledger.rglob("distill_summary.json"))  # stage 1 only: not the claim's run
    assert distillation.distill_run(clone("a"), "hedgehog", 0)["stage2"] == {}
    assert len(list(ledger.rglob("distill_summary.json"))) == 1
    trained.clear()
    assert distillation.transfer_run(clone("b"), "hedgehog", 0)["transfer"]["drop"] == 0.1
    assert "stage2" in distillation.distill_run(clone("b"), "hedgehog", 0)
    assert distillation.teacher_run(clone("b"), "listops", 0)["test"]["accuracy"] == 0.6
    assert trained == []  # all read from the ledger
    for f in ledger.rglob("transfer_summary.json"):
        f.unlink()
    assert distillation.transfer_run(clone("c"), "hedgehog", 0)["transfer"]["drop"] == 0.1
    assert sorted(trained) == [("distill", "c"), ("teacher", "c"), ("teacher", "c"),
                               ("transfer", "c")]  # fmt: skip


def test_every_claim_is_registered_with_its_rule_command_and_compute():
    found = claims.all_claims()
    for key in ("ra.beats_rfa_fidelity", "rfa.biased", "ra.lra", "lara.multi_proposal",
                "lara.decoupled_weights", "lara.gaussian_vs_mixture",
                "laplacian.gradient_stability", "flexformer.lm"):  # fmt: skip
        assert key in found
    assert len(found) == 23
    for c in found.values():
        assert c.rule and c.compute and c.command.endswith(f"--only {c.key}"), c.key
    with pytest.raises(ValueError, match="rule must state"):
        claims.claim("x.y", paper="RA / LARA", statement="S", experiment="E", rule=" ")


def test_report_shows_an_older_finding_as_pending(tmp_path, toy_claim):
    old = claims.Settings(seeds=3, workdir=tmp_path, findings=tmp_path)
    claims.run(claims.select(["toy.claim"]), old, log=lambda *_: None)
    new = dataclasses.replace(old, seeds=5)
    assert claims.load(new, "toy.claim") is None
    text = claims.report(new)
    assert "pending (earlier: partly)" in text and "other settings seeds=3" in text
    record = json.loads((tmp_path / "toy.claim.json").read_text())
    record["code"] = "0" * 16  # made with other code: not current either
    (tmp_path / "toy.claim.json").write_text(json.dumps(record))
    assert claims.load(old, "toy.claim") is None
    assert "made with other code" in claims.report(old)


def test_vanishing_gradient_shares_on_distances_with_a_far_tail():
    """Pairs far out (a heavy tail) keep a Laplace gradient where the Gaussian's vanishes."""
    from train.claims import trained

    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 32, 1, 4))
    k = rng.normal(size=(1, 32, 1, 4))
    k[0, :4] *= 8.0  # four far keys
    lap, gau, far = trained.vanishing_shares(q, k, None)
    assert lap < gau and gau > 0.05 and far > 10, (lap, gau, far)


def test_rfa_bias_falls_with_features_and_ra_is_the_unbiased_control():
    from train.claims import randomized

    found = randomized.rfa_biased(claims.Settings(seeds=1, quick=True))
    rms = {m: b for m, (_, b) in found.data["rfa"].items()}
    assert rms[32] < rms[8] < rms[2], rms  # the O(1/M) bias of the ratio estimator
    assert found.data["ra"][0] < 4.5  # RA's mean is within noise of softmax attention
    assert found.verdict in (claims.REPRODUCED, claims.PARTLY, claims.NOT_REPRODUCED)


def test_runs_queue_lists_states_and_trains_only_unfinished_runs(tmp_path, monkeypatch, capsys):
    import subprocess

    from train.claims import runs

    g = runs.groups(2)
    assert len(g["table"]) == len(table.TASKS) * len(table.MECHANISMS) * 2
    assert [str(r) for r in g["table"][:3]] == ["listops:softmax:0", "listops:softmax:1",
                                                "listops:performer:0"]  # fmt: skip
    assert runs.expand(["lm:rfa:1", "lm", "lm:rfa:1"], 2).count(runs.Run("lm", "rfa", 1)) == 1
    for bad in ("listops:nope:0", "lm:lara:0", "listops:softmax", "listops:softmax:-1"):
        with pytest.raises(ValueError, match=f"run '{bad}'"):
            runs.parse(bad)
    settings = claims.Settings(quick=True, workdir=tmp_path)
    _fake_runs(tmp_path, {("listops", "softmax", 0): 0.4})
    config, path = runs.config_and_dir(settings, runs.Run("listops", "rfa", 0))
    run_cache.prepare(path, run_cache.run_key(config), log=lambda *_: None)  # started
    config, path = runs.config_and_dir(settings, runs.Run("listops", "performer", 0))
    run_cache.prepare(path, {"config": "another"}, log=lambda *_: None)  # stale
    items = ["listops:softmax:0", "listops:rfa:0", "listops:performer:0", "lm:softmax:0"]
    commands = []

    def fake_run(cmd, check):
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(runs.subprocess, "run", fake_run)
    common = ["--quick", "--workdir", str(tmp_path)]
    assert runs.main(["--list", *common, *items]) == dict(
        zip(items, ("finished", "started", "stale", "pending"), strict=True))  # fmt: skip
    assert commands == []
    assert "listops:softmax:0                        finished accuracy 0.4000" in (
        capsys.readouterr().out)  # fmt: skip
    # --code reads the runs of another code version: the stale one (key of the config, code
    # "old") is finished there, the current ones are not
    config, path = runs.config_and_dir(settings, runs.Run("listops", "performer", 0))
    old = {**run_cache.run_key(config), "code": "old"}
    (path / run_cache.RUN_KEY).write_text(json.dumps(old))
    (path / "summary.json").write_text(json.dumps({"test": {"accuracy": 0.25}}))
    assert runs.main(["--list", "--code", "old", *common, *items[:3]]) == dict(
        zip(items, ("stale", "stale", "finished"), strict=False))  # fmt: skip
    assert "listops:performer:0                      finished accuracy 0.2500" in (
        capsys.readouterr().out)  # fmt: skip
    for bad in (["--code", "old", "listops:rfa:0"], ["--list", "--code", "old", "distill:rfa:0"]):
        with pytest.raises(SystemExit):
            runs.main([*common, *bad])
        assert "--code reads" in capsys.readouterr().err
    assert runs.main(["--jobs", "2", *common, *items]) == dict.fromkeys(items, "finished")
    assert sorted(c[c.index("--one") + 1] for c in commands) == sorted(items[1:])
    assert all(c[1:3] == ["-m", "train.claims.runs"] and c[-3:] == ["--workdir", str(tmp_path),
               "--quick"] for c in commands)  # fmt: skip


def test_runs_summary_reads_means_intervals_and_diagnostics():
    from train.claims import runs

    assert {r.arm for r in runs.groups(1)["flexformer"]} == {
        "flexformer_n", *table.FLEXFORMER_VARIANTS}  # fmt: skip
    summ = {
        runs.Run("listops", "flexformer_n", 0): {"test": {"accuracy": 0.20}},
        runs.Run("listops", "flexformer_n", 1): {"test": {"accuracy": 0.24}},
        runs.Run("listops", "flexformer_n_lr10", 0): {
            "test": {"accuracy": 0.30}, "kernel": {"end": {"kernel/scale_ratio": 1.1}}},
        runs.Run("listops", "flexformer_n_lr10", 1): {
            "test": {"accuracy": 0.34}, "kernel": {"end": {"kernel/scale_ratio": 1.3}}},
        runs.Run("lm", "softmax", 0): {"test": {"bits_per_byte": 2.5}},
    }  # fmt: skip
    lines = runs.summary_lines([*summ, runs.Run("listops", "softmax", 0)], summ)
    assert len(lines) == 3 and lines[0].startswith("listops    flexformer_n ")
    assert "n=2 accuracy 22.00 +- 2.83 (0: 20.00, 1: 24.00)" in lines[0]
    d, lo, hi = (100 * x for x in stats.interval([0.30, 0.34], [0.20, 0.24], "welch"))
    assert f"- flexformer_n {d:+.2f} [{lo:+.2f}, {hi:+.2f}]; end scale_ratio 1.2" in lines[1]
    assert lines[2].endswith("n=1 bits_per_byte 2.500 (0: 2.500)")
    flipped = runs.summary_lines(list(summ), summ, against="flexformer_n_lr10")
    assert f"- flexformer_n_lr10 {-d:+.2f} [{-hi:+.2f}, {-lo:+.2f}]" in flipped[0]


def test_runs_queue_orders_distillation_runs_after_their_teachers(tmp_path, monkeypatch):
    import subprocess

    from train.claims import distillation, runs

    g = runs.groups(1)
    assert [str(r) for r in g["transfer"]] == [
        "distill:teacher:0", "transfer:teacher:0", "transfer:flexformer_n:0", "transfer:hedgehog:0"
    ]  # fmt: skip
    assert [runs.phase(runs.parse(x)) for x in ("distill:teacher:0", "listops:rfa:0",
            "distill:rfa:0", "transfer:hedgehog:0")] == [0, 0, 1, 2]  # fmt: skip
    settings = claims.Settings(quick=True, workdir=tmp_path)
    # a distillation without its stage 2 (a transfer's stage 1) is not finished; with it, it is
    key, path, name = distillation.queued_run(settings, "distill", "rfa", 0)
    run_cache.prepare(path, key, log=lambda *_: None)
    (path / name).write_text(json.dumps({"recovery": 0.9}))
    assert runs.state(settings, runs.Run("distill", "rfa", 0)) == ("started", None)
    done = {"recovery": 0.9, "stage2": {"test": {"accuracy": 0.375}}}
    (path / name).write_text(json.dumps(done))
    assert runs.state(settings, runs.Run("distill", "rfa", 0)) == ("finished", done)
    assert runs.result(runs.Run("distill", "rfa", 0), done) == ("accuracy", 0.375)
    assert runs.result(runs.Run("transfer", "hedgehog", 0), {"drop": 0.05}) == ("drop", 0.05)
    monkeypatch.setattr(distillation, "train_queued", lambda *a: {"drop": 0.05})  # --one's line
    assert runs.main(["--one", "transfer:hedgehog:0"]) == {"transfer:hedgehog:0": "finished"}
    started = []

    def fake_run(cmd, check):
        started.append(cmd[cmd.index("--one") + 1])
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(runs.subprocess, "run", fake_run)
    items = ["transfer:flexformer_n:0", "distill:performer:0", "distill:teacher:0", "distill:rfa:0"]
    runs.main(["--jobs", "2", "--quick", "--workdir", str(tmp_path), *items])
    assert started[0] == "distill:teacher:0" and started[-1] == "transfer:flexformer_n:0"
