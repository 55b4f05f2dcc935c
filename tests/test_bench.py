"""train.bench: end-to-end smoke runs on tiny sizes (every mechanism present, figures positive)
and the bookkeeping (ratios, extrapolation, crossings, growth, merging, isolation) on known
synthetic points."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import pytest

import linattn_jax as la
from train import bench
from train.bench import peers, timing


def _run(capsys, argv):
    result = bench.main(argv)
    return result, capsys.readouterr().out


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


# The smoke runs are split into two halves of the registry (softmax in both, as the ratios'
# reference) so that pytest-xdist can spread them over its workers; together they cover every
# registered mechanism.
PARTS = (0, 1)


def _part(part: int) -> list[str]:
    return ["softmax"] + [n for n in la.names() if n != "softmax"][part :: len(PARTS)]


@pytest.mark.filterwarnings("error:No artists with labels:UserWarning")  # an empty plot fails
@pytest.mark.parametrize("part", PARTS)
def test_scaling_smoke_every_mechanism(tmp_path, capsys, part):
    # Forward only here (compiling every backward twice would double the cost); the backward
    # pass of every mechanism is compiled and timed by the model smoke test, and the fwd_bwd
    # scaling path by test_scaling_modes_passes_and_report.
    out, png = tmp_path / "scaling.json", tmp_path / "scaling.png"
    result, stdout = _run(
        capsys,
        [
            "scaling",
            "--seq-lens",
            "64",
            "128",
            "--repeats",
            "1",
            "--min-total-s",
            "10",
            "--modes",
            "noncausal",
            "--passes",
            "fwd",
            "--no-isolate",
            "--quiet",
            "--out",
            str(out),
            "--plot",
            str(png),
            "--mechanisms",
            *_part(part),
            bench.SOFTMAX_XLA,
        ],
    )
    names = peers.peer_names(_part(part) + [bench.SOFTMAX_XLA])  # lara_peer after lara
    assert result["mechanisms"] == names
    saved = json.loads(out.read_text())
    assert saved["mechanisms"] == names
    for name in names:
        assert f"| {name} |" in stdout, name
        for t in (64, 128):
            (p,) = [q for q in saved["points"] if q["mechanism"] == name and q["seq_len"] == t]
            assert p["status"] == "ok", (name, t, p["note"])
            assert _positive(p["time_ms"]) and p["n_timed"] == 1
            mem = p["memory"]
            assert _positive(mem["total"])
            assert mem["total"] == mem["temp"] + mem["argument"] + mem["output"]
            assert _positive(p["ratio_time"]) and _positive(p["ratio_memory"])
            assert _positive(p["ratio_time_xla"])
    soft = [p for p in saved["points"] if p["mechanism"] == "softmax"]
    assert all(p["ratio_time"] == 1.0 and p["ratio_memory"] == 1.0 for p in soft)
    assert png.stat().st_size > 10_000


def test_scaling_modes_passes_and_report(tmp_path, capsys):
    out = tmp_path / "s.json"
    names = ["softmax", "linear_elu", "nystromformer"]
    _run(
        capsys,
        ["scaling", "--seq-lens", "32", "64", "--repeats", "1", "--passes", "fwd", "fwd_bwd"]
        + ["--no-isolate", "--quiet", "--out", str(out), "--mechanisms", *names],
    )
    result = json.loads(out.read_text())
    got = {(p["mechanism"], p["mode"], p["pass"]) for p in result["points"]}
    for name in names:
        modes = ("noncausal", "causal") if la.get(name).supports_causal else ("noncausal",)
        assert {(name, m, s) for m in modes for s in bench.PASSES} == {
            g for g in got if g[0] == name
        }
    text = bench.report(result)
    # The summary table at the largest T lists every mechanism, with its growth per doubling.
    assert "fwd+bwd at T=64, noncausal" in text and "fwd+bwd at T=64, causal" in text
    for name in names:
        assert f"| {name} | " in text
    assert "->64:" in text


def test_matmul_flops_counts_products_scan_bodies_and_gradients():
    x, w = jnp.ones((8, 6)), jnp.ones((6, 5))

    def one(x, w):
        return x @ w

    compiled = jax.jit(one).lower(x, w).compile().cost_analysis()
    assert timing.matmul_flops(one, (x, w)) == 2 * 8 * 5 * 6 == compiled["flops"]

    def scan3(x, w):  # XLA's cost_analysis counts this body once
        return jax.lax.scan(lambda c, _: (c @ w, None), x @ w[:, :6].T, None, length=3)[0]

    w = jnp.ones((6, 6))
    assert timing.matmul_flops(scan3, (x, w)) == 4 * 2 * 8 * 6 * 6
    grad = jax.grad(lambda x, w: scan3(x, w).sum())  # 4 products forward, 4 backward (dx)
    assert timing.matmul_flops(grad, (x, w)) == 8 * 2 * 8 * 6 * 6


def test_scaling_flop_rate(tmp_path, capsys):
    out = tmp_path / "s.json"
    _, stdout = _run(
        capsys,
        ["scaling", "--seq-lens", "128", "256", "--repeats", "1", "--passes", "fwd", "--flop-rate"]
        + ["--heads", "1", "--head-dim", "4", "--no-isolate", "--quiet", "--out", str(out)]
        + ["--mechanisms", "linear_elu"],
    )
    result = json.loads(out.read_text())
    refs = result["reference"]  # before and after the mechanisms, per T
    assert [r["seq_len"] for r in refs] == [128, 256, 128, 256]
    assert all(
        r["matmul_flops"] == 2 * r["seq_len"] * 4 * 4 and _positive(r["gflops"]) for r in refs
    )
    flops = {(p["mode"], p["seq_len"]): p["matmul_flops"] for p in result["points"]}
    for p in result["points"]:
        assert _positive(p["gflops"]) and p["gflops"] == pytest.approx(
            p["matmul_flops"] / p["time_ms"] / 1e6
        )
    for mode in ("noncausal", "causal"):  # linear in T: the causal scan over 2 and 4 chunks
        assert flops[(mode, 256)] == 2 * flops[(mode, 128)], mode
    assert flops[("causal", 256)] > flops[("noncausal", 256)]  # + the quadratic in-chunk part
    assert "#### effective FLOP rate at T=256" in stdout
    assert "| linear_elu | " in stdout and "[256, 4] @ [4, 4]" in stdout


@pytest.mark.parametrize("part", PARTS)
def test_fidelity_smoke_every_mechanism(tmp_path, capsys, part):
    out, png = tmp_path / "fid.json", tmp_path / "fid.png"
    budgets = [4, 8]
    _, stdout = _run(
        capsys,
        ["fidelity", "--budgets", *map(str, budgets), "--seeds", "2", "--seq-len", "32"]
        + ["--heads", "1", "--head-dim", "8", "--quiet", "--out", str(out), "--plot", str(png)]
        + ["--mechanisms", *_part(part)],
    )
    result = json.loads(out.read_text())
    names = _part(part)[1:]  # softmax is the reference, not a row
    assert result["mechanisms"] == names
    for name in names:
        assert f"| {name} |" in stdout
        keys = bench.budget_keys(name)
        for kind in ("gaussian", "clustered"):
            rows = [r for r in result["rows"] if r["mechanism"] == name and r["inputs"] == kind]
            expected = {(k, b) for k in keys for b in budgets} if keys else {(None, None)}
            assert {(r["budget_key"], r["budget"]) for r in rows} == expected, name
            for r in rows:
                assert len(r["errors"]) == 2 and all(_positive(e) for e in r["errors"])
                assert r["mean"] == pytest.approx(sum(r["errors"]) / 2)
                assert math.isfinite(r["std"]) and r["std"] >= 0
    assert png.stat().st_size > 10_000
    assert bench.fidelity_table(result) in bench.report(fidelity=result)


@pytest.mark.parametrize("part", PARTS)
def test_model_smoke_every_mechanism(tmp_path, capsys, part):
    out = tmp_path / "model.json"
    png = tmp_path / "model.png"
    _, stdout = _run(
        capsys,
        ["model", "--seq-len", "32", "--batch", "2", "--dim", "16", "--heads", "2", "--mlp", "16"]
        + ["--layers", "1", "--repeats", "1", "--min-total-s", "10", "--no-isolate", "--quiet"]
        + ["--out", str(out), "--plot", str(png), "--mechanisms", *_part(part)],
    )
    result = json.loads(out.read_text())
    assert [p["mechanism"] for p in result["points"]] == _part(part)
    for p in result["points"]:
        assert f"| {p['mechanism']} |" in stdout
        assert p["status"] == "ok", p
        assert _positive(p["time_ms"]) and p["n_timed"] == 1
        assert _positive(p["memory"]["total"])
        assert _positive(p["ratio_time"]) and _positive(p["ratio_memory"])
        assert p["num_params"] > 0
    assert png.stat().st_size > 5_000
    assert bench.model_table(result) in bench.report(model=result)


def test_model_point_takes_the_mechanism_options():
    from train.bench import model

    shape = dict(seq_len=16, batch=1, dim=16, heads=2, mlp=16, layers=1, repeats=1, min_total_s=0)
    points = [model.model_point("flexformer_n", attention_config={"num_features": m}, **shape)
              for m in (4, 8)]  # fmt: skip
    # omega1, omega2 [H, M, d] per layer: 2 x 2 x 4 x 8 more params at M = 8
    assert points[1]["num_params"] - points[0]["num_params"] == 2 * 2 * 4 * 8


def test_isolated_run_and_timeout(tmp_path, capsys):
    argv = ["scaling", "--seq-lens", "32", "--modes", "noncausal", "--passes", "fwd"]
    argv += ["--repeats", "1", "--quiet", "--mechanisms", "linear_elu"]
    result, _ = _run(capsys, argv + ["--out", str(tmp_path / "a.json")])
    (p,) = result["points"]
    assert p["status"] == "ok" and _positive(p["time_ms"])
    # A subprocess that cannot finish in time is killed and reported, not waited for.
    result, stdout = _run(capsys, argv + ["--mechanism-timeout-s", "0.01"])
    (p,) = result["points"]
    assert p["status"] == "error" and "timed out" in p["note"]
    assert "timed out" in stdout


def test_strip_parent_flags():
    argv = ["scaling", "--mechanisms", "a", "b", "--seq-lens", "1", "2", "--quiet"]
    argv += ["--isolate", "--out=x.json", "--repeats", "3", "--plot", "p.png"]
    assert bench.strip_flags(argv, bench.PARENT_ONLY) == [
        "scaling",
        "--seq-lens",
        "1",
        "2",
        "--repeats",
        "3",
    ]


def _pt(name, t, ms, mem, mode="noncausal", pass_="fwd_bwd", status="ok"):
    p = {
        "mechanism": name,
        "seq_len": t,
        "mode": mode,
        "pass": pass_,
        "status": status,
        "memory": {"total": mem},
    }
    if ms is not None:
        p["time_ms"] = ms
    return p


def test_ratios_extrapolate_skipped_softmax_quadratically():
    points = [
        _pt("softmax", 1024, 10.0, 100),
        _pt("softmax", 2048, 40.0, 400),
        _pt("softmax", 4096, None, 1600, status="skipped"),
        _pt("softmax_xla", 1024, 5.0, 100),
        _pt("softmax_xla", 2048, 20.0, 400),
        _pt("softmax_xla", 4096, 80.0, 1600),
        _pt("lin", 1024, 20.0, 50),
        _pt("lin", 2048, 40.0, 100),
        _pt("lin", 4096, 80.0, 200),
    ]
    bench.add_ratios(points)
    lin = {p["seq_len"]: p for p in points if p["mechanism"] == "lin"}
    assert lin[1024]["ratio_time"] == 2.0 and not lin[1024]["ratio_time_extrapolated"]
    assert lin[2048]["ratio_time"] == 1.0
    # softmax at 4096 extrapolated from 2048 as T^2: 160 ms.
    assert lin[4096]["ratio_time"] == 0.5 and lin[4096]["ratio_time_extrapolated"]
    assert lin[4096]["ratio_time_xla"] == 1.0 and not lin[4096]["ratio_time_xla_extrapolated"]
    assert lin[4096]["ratio_memory"] == 200 / 1600  # compiled memory: never extrapolated
    # lin/softmax: 2, 1, 0.5 -> crosses 1 exactly at T = 2048 (log-interpolated).
    assert bench.crossing(points, "lin", "noncausal") == "~2048 (vs extrapolated softmax)"
    growth = bench.growth_per_doubling(points, "lin", "noncausal")
    assert growth == [(2048, 2.0), (4096, 2.0)]
    assert bench.growth_per_doubling(points, "softmax", "noncausal") == [(2048, 4.0)]


def test_crossing_cases():
    points = [_pt("softmax", t, 1.0, 1) for t in (64, 128, 256)]
    points += [_pt("fast", t, 0.5, 1) for t in (64, 128, 256)]
    points += [_pt("slow", t, 3.0, 1) for t in (64, 128, 256)]
    points += [_pt("mid", 64, 4.0, 1), _pt("mid", 128, 1.0 / 4.0, 1)]
    bench.add_ratios(points)
    assert bench.crossing(points, "fast", "noncausal").startswith("< 64")
    assert bench.crossing(points, "slow", "noncausal").startswith("> 256")
    assert bench.crossing(points, "mid", "noncausal") == "~91"  # geometric midpoint of 64, 128


def test_predicted_time_and_merge():
    assert bench.predict_seconds([], 2048, True) is None
    assert bench.predict_seconds([(1024, 1.0)], 4096, True) == 16.0
    assert bench.predict_seconds([(1024, 1.0)], 4096, False) == 4.0
    assert bench.predict_seconds([(1024, 1.0), (2048, 1.5)], 4096, False) == 3.0  # slope >= 1
    a = {
        "kind": "scaling",
        "environment": {},
        "config": {"modes": ["noncausal"], "passes": ["fwd_bwd"], "seq_lens": [64]},
        "mechanisms": ["linear_elu", "softmax"],
        "points": [_pt("softmax", 64, 2.0, 10), _pt("linear_elu", 64, 1.0, 5)],
    }
    b = {
        "kind": "scaling",
        "environment": {},
        "config": {"modes": ["noncausal"], "passes": ["fwd"], "seq_lens": [64]},
        "mechanisms": ["softmax"],
        "points": [_pt("softmax", 64, 1.0, 10, pass_="fwd")],
    }
    # A measured point is kept; only a point without a time is filled by a later run.
    a["points"].append(_pt("linear_elu", 128, None, 9, status="skipped"))
    b["points"] += [_pt("softmax", 64, 7.0, 10), _pt("linear_elu", 128, 3.0, 9)]
    m = bench.merge_scaling([a, b])
    assert [p["time_ms"] for p in m["points"] if p["mechanism"] == "softmax"] == [2.0, 1.0]
    assert [p["time_ms"] for p in m["points"] if p["seq_len"] == 128] == [3.0]
    assert m["mechanisms"] == ["softmax", "linear_elu"]  # registry order
    assert m["config"]["passes"] == ["fwd_bwd", "fwd"]
    (lin,) = [p for p in m["points"] if p["mechanism"] == "linear_elu" and p["seq_len"] == 64]
    assert lin["ratio_time"] == 0.5 and lin["ratio_memory"] == 0.5


def test_parts_cover_the_registry():
    assert sorted({n for part in PARTS for n in _part(part)}) == sorted(la.names())


def test_relative_error_and_inputs():
    x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    assert bench.relative_error(x, x) == 0.0
    assert bench.relative_error(2 * x, x) == pytest.approx(1.0)
    kw = dict(batch=2, seq_len=16, heads=3, head_dim=8)
    for kind in ("gaussian", "clustered"):
        q, k, v = bench.make_inputs(kind, jax.random.key(1), **kw)
        assert q.shape == k.shape == v.shape == (2, 16, 3, 8)
    # Clustered tokens: each query's softmax mass lies on the keys of its own cluster.
    q, k, _, cq, ck = bench.make_inputs(
        "clustered",
        jax.random.key(2),
        clusters=2,
        center_scale=2.0,
        noise=0.1,
        return_clusters=True,
        **kw,
    )
    w = la.softmax.attention_weights(q, k)  # [B, H, Tq, Tk]
    same = cq.transpose(0, 2, 1)[..., :, None] == ck.transpose(0, 2, 1)[..., None, :]
    has_own = jnp.any(same, axis=-1)  # queries whose cluster has at least one key
    own_mass = jnp.sum(jnp.where(same, w, 0.0), axis=-1)
    assert bool(jnp.all(jnp.where(has_own, own_mass, 1.0) > 0.99))
    with pytest.raises(ValueError, match="inputs kind"):
        bench.make_inputs("uniform", jax.random.key(0), **kw)


def test_unknown_mechanism_raises():
    with pytest.raises(KeyError, match="nope"):
        bench.bench_names(["softmax", "nope"])


def test_fidelity_configs_cap_quadratic_budgets():
    assert bench.fidelity_configs("softmax", [4, 8]) == [(None, None)]
    assert bench.fidelity_configs("performer", [4, 8]) == [
        ("num_features", 4),
        ("num_features", 8),
    ]
    quadratic = [n for n in la.names() if bench.is_quadratic(n) and bench.budget_keys(n)]
    for name in quadratic:
        assert all(b <= 8 for _, b in bench.fidelity_configs(name, [4, 8, 16], 8))


def test_kernels_subcommand_passes_flags_through(tmp_path, capsys):
    out = tmp_path / "k.json"
    argv = ["kernels", "--n", "8", "--m", "8", "--d", "4", "--ns-bh", "1", "--ns-sizes", "8"]
    argv += ["--iters", "2", "--repeats", "1", "--skip-l1-reference", "--out", str(out)]
    table, stdout = _run(capsys, argv)
    rows = [r for r in table.splitlines() if r.startswith(("| laplace", "| newton"))]
    # xla + pallas for the Laplace kernel (reference skipped), reference + xla + pallas for NS.
    assert len(rows) == 5 and all("N=8 M=8 D=4" in r for r in rows[:2])
    assert json.loads(out.read_text())["table"] == table
    assert table in stdout


def test_merge_model_replaces_points_and_recomputes_ratios():
    def res(points):
        return {"kind": "model", "environment": {}, "config": {}, "points": points}

    first = res(
        [
            {"mechanism": "softmax", "status": "skipped", "memory": {"total": 100}},
            {"mechanism": "linear_elu", "status": "ok", "time_ms": 5.0, "memory": {"total": 10}},
        ]
    )
    rerun = res(
        [
            {"mechanism": "softmax", "status": "ok", "time_ms": 20.0, "memory": {"total": 80}},
            {"mechanism": "linear_elu", "status": "ok", "time_ms": 9.0, "memory": {"total": 10}},
        ]
    )
    m = bench.merge_model([first, rerun])
    assert [p["mechanism"] for p in m["points"]] == ["softmax", "linear_elu"]
    lin = m["points"][1]
    assert lin["ratio_time"] == 0.25 and lin["ratio_memory"] == 10 / 80


def test_report_subcommand_reads_the_json_files(tmp_path, capsys):
    scaling = {
        "kind": "scaling",
        "environment": {"backend": "cpu", "cpu_count": 2, "loadavg": None},
        "config": {
            "modes": ["noncausal"],
            "passes": ["fwd_bwd"],
            "seq_lens": [64, 128],
            "batch": 1,
            "heads": 1,
            "head_dim": 8,
        },
        "mechanisms": ["softmax", "linear_elu"],
        "points": bench.add_ratios(
            [_pt("softmax", t, ms, 10) for t, ms in ((64, 1.0), (128, 4.0))]
            + [_pt("linear_elu", t, ms, 5) for t, ms in ((64, 2.0), (128, 2.0))]
        ),
    }
    fidelity = {
        "config": {"budgets": [4], "inputs": ["gaussian"], "seq_len": 32, "seeds": 2},
        "rows": [
            {"mechanism": "performer", "budget_key": "num_features", "budget": 4}
            | {"inputs": "gaussian", "mean": 0.5, "std": 0.1}
        ],
    }
    model = {
        "config": {"seq_len": 32, "batch": 2, "layers": 1, "dim": 16, "heads": 2},
        "points": [{"mechanism": "softmax", "status": "ok", "time_ms": 3.0, "memory": {}}],
    }
    paths = {}
    for name, result in (("scaling", scaling), ("fidelity", fidelity), ("model", model)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(result))
    text, stdout = _run(
        capsys,
        ["report", "--scaling", str(paths["scaling"]), "--fidelity", str(paths["fidelity"])]
        + ["--model", str(paths["model"]), "--at-seq-len", "128"],
    )
    assert text == bench.report(scaling=[scaling], fidelity=fidelity, model=[model], at_seq_len=128)
    assert text in stdout
    assert "fwd+bwd at T=128, noncausal" in text and "| linear_elu | 2.00 ms | 0.50x" in text
    assert "| performer | num_features | 0.500 +- 0.100 |" in text
    assert "| softmax | 3.00 ms |" in text


def test_parallel_subcommand(capsys):
    argv = ["parallel", "--attentions", "linear_elu", "--seq_len", "64", "--shards", "2"]
    rows, stdout = _run(capsys, argv)
    assert [(r["attention"], r["causal"], r["pass"]) for r in rows] == [
        ("linear_elu", c, p) for c in (False, True) for p in ("fwd", "fwd_bwd")
    ]
    assert all(_positive(r["one"]) and _positive(r[2]) for r in rows)
    fwd, fwd_bwd = rows[0], rows[1]
    assert fwd["one"] < fwd_bwd["one"]  # the backward pass holds more
    assert "| linear_elu | False | fwd_bwd |" in stdout and "2 devices (ratio)" in stdout
    rows, _ = _run(capsys, [*argv, "--passes", "fwd"])
    assert [r["pass"] for r in rows] == ["fwd", "fwd"]
    with pytest.raises(SystemExit):  # an unknown pass
        bench.main([*argv, "--passes", "bwd"])
    assert "--passes 'bwd'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # more shards than devices: a clear error, not a crash
        bench.main(argv[:-1] + ["1024"])
    assert "xla_force_host_platform_device_count=1024" in capsys.readouterr().err
