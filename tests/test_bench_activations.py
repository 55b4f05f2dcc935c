"""train.bench_activations: the pieces of ``python -m train.bench_activations`` at tiny shapes,
and the pin of the stability measure (flexformer_n's spread across meshes against
softmax's)."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linattn_jax as la
from linattn_jax import flexformer as ff
from linattn_jax.linen import MultiHeadAttention
from train import bench_activations as ba


def _qk(seed, b=2, t=12, h=2, d=8, scale=1.0):
    kq, kk = jax.random.split(jax.random.key(seed))
    return (
        scale * jax.random.normal(kq, (b, t, h, d)),
        scale * jax.random.normal(kk, (b, t, h, d)),
    )


def test_denominators_have_the_sign_of_the_kernel_row_sums():
    """den_i is the row sum of phi~(q_i) . phi~(k_j) times a positive per-row factor (the
    stabilisers), over the visible keys: masked keys and, when causal, the future excluded."""
    q, k = _qk(0, scale=3.0)  # large norms: the raw map gives denominators of both signs
    mask = jnp.arange(12)[None, :] < jnp.array([[12], [9]])
    params = la.get("flexformer_n").init(jax.random.key(1), num_heads=2, head_dim=8,
                                         num_features=4)  # fmt: skip
    raw = (("qk_radius", None), ("features", "trig"))
    for causal in (False, True):
        den = ba.denominators("flexformer_n", params, q, k, mask=mask, causal=causal, config=raw)
        kern = ff.kernel(q, k, params, qk_radius=None, features="trig")  # [B, H, Tq, Tk]
        vis = mask[:, None, None, :] & (
            jnp.tril(jnp.ones((1, 1, 12, 12), bool)) if causal else True
        )
        rows = jnp.sum(jnp.where(vis, kern, 0.0), axis=-1)
        np.testing.assert_array_equal(np.sign(den), np.sign(rows))
        assert bool(jnp.any(den < 0))  # the case the bench counts does occur here


def test_denominator_fractions():
    den = np.array([[[-1.0, 1e-5, 1.0, 2.0, 3.0]]])  # [B=1, H=1, T=5]
    rows = np.array([[True, True, True, True, False]])
    neg, tiny = ba.denominator_fractions([den], [rows])
    assert (neg, tiny) == (0.25, 0.25)  # median |den| over valid rows = 1.0


def test_weight_rows_bound_and_floor_stats():
    """The mass channel is stripped (the default map's den equals the unfloored map's), the
    l1 row sums lie between |den| and the bound, and `floor_stats` counts floored rows and
    the l1 norms with and without the floor."""
    q, k = _qk(2, scale=3.0)
    params = la.get("flexformer_n").init(jax.random.key(3), num_heads=2, head_dim=8,
                                         num_features=4)  # fmt: skip
    den, l1, bound = ba.weight_rows("flexformer_n", params, q, k, causal=True)
    np.testing.assert_array_equal(
        np.asarray(den),
        np.asarray(
            ba.denominators("flexformer_n", params, q, k, causal=True, config=(("den_floor", 0.0),))
        ),  # fmt: skip
    )
    assert bool(jnp.all(jnp.abs(den) <= l1 * (1 + 1e-5))) and bool(jnp.all(l1 <= bound * 1.0001))
    stats = (np.array([[[0.5, -0.01, 0.2]]]), np.array([[[0.5, 0.4, 0.3]]]), np.ones((1, 1, 3)))
    floored, worst, raw = ba.floor_stats([stats], [np.array([[True, True, False]])], 0.1)
    assert floored == 0.5 and worst == 4.0 and raw == 40.0  # rows 0, 1; row 1: 0.4 / 0.1


class _Tied(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic=True):
        attn = MultiHeadAttention(num_heads=2, attention="flexformer_s",
                                  attention_config=(("num_features", 4),))  # fmt: skip
        return attn(attn(x))  # one layer called twice (as ListOps' tied layers)


def test_capture_returns_q_k_v_and_params_of_every_call():
    x = jax.random.normal(jax.random.key(0), (1, 10, 8))
    model = _Tied()
    variables = nn.meta.unbox(model.init(jax.random.key(1), x))
    caps = ba.capture(model, variables, x)
    assert len(caps) == 2 and caps[0].path == caps[1].path
    p = variables["params"]["MultiHeadAttention_0"]
    for cap in caps:
        assert cap.q.shape == cap.k.shape == cap.v.shape == (1, 10, 2, 4)
        np.testing.assert_array_equal(cap.params["omega_tilde"], p["mechanism"]["omega_tilde"])
    want_v0 = jnp.einsum("btf,fhd->bthd", x, p["value"]["kernel"]) + p["value"]["bias"][None, None]
    np.testing.assert_allclose(caps[0].v, want_v0, rtol=1e-5, atol=1e-6)
    assert not np.allclose(caps[0].v, caps[1].v)  # the second call's values, not the first's


def test_laplacian_stats_small():
    q, k = _qk(2, b=1, t=16, h=1, d=4)
    v = jax.random.normal(jax.random.key(3), (1, 16, 1, 3))
    params = la.get("laplacian").init(jax.random.key(4), num_heads=1, head_dim=4)
    cap = ba.Capture(("l",), q, k, v, None, False, params)
    r = ba.laplacian_stats([cap], {"num_landmarks": 4}, iters=(5, 30), landmarks=(True,))
    assert 0.5 < r["median_l1_over_d"] < 2.0  # unit Gaussians: E|x - y| = 2 / sqrt(pi)
    shared = r["landmarks"]["shared"]
    assert shared["residual"][30] < 1e-3 and shared["residual"][30] <= shared["residual"][5]
    assert shared["triple"] < 1e-2 and shared["sigma_min"] > 0
    # total variance = within-sequence (query-dependent) + between the sequence means
    assert 0 < shared["query_scale"] <= shared["scale"] * (1 + 1e-9)
    lo, mid, hi = r["kernel_q"]["d/2"]
    assert 0 < lo <= mid <= hi <= 1


def test_kernel_stats_on_unit_gaussians():
    """Unit-Gaussian q, k (d = 16): median |q - k|_1 / d near 2 / sqrt(pi) = 1.13 and
    |q - k|_2^2 / d near 2, and at lambda = d / 2 the two kernels' median entries within 25%
    (laplacian's kernel="gaussian" bandwidth); only the valid pairs count."""
    q, k = _qk(5, b=2, t=32, h=1, d=16)
    mask = jnp.arange(32)[None, :] < jnp.array([32, 20])[:, None]
    junk = q.at[1, 20:].set(100.0)  # padded rows: far from everything, must not count
    cap = ba.Capture(("l",), junk, k, k, mask, False, {})
    r = ba.kernel_stats([cap])
    assert abs(r["median_l1_over_d"] - 2 / math.sqrt(math.pi)) < 0.1, r
    assert abs(r["median_l2sq_over_d"] - 2.0) < 0.25, r
    assert 0.8 < r["gaussian"][1] / r["laplace"][1] < 1.25, r
    for name in ("laplace", "gaussian"):
        lo, mid, hi = r[name]
        assert 0 < lo <= mid <= hi <= 1


def test_mock_image_task_batches():
    task = ba.mock_image_task(20, 8, classes=4)
    batch = task.train_batch(0, 4, seed=0)
    assert batch["inputs"].shape == (4, 8, 8, 3) and batch["inputs"].dtype == np.uint8
    assert set(np.asarray(task.train_batch(1, 20, seed=0)["targets"])) == {0, 1, 2, 3}


@pytest.mark.slow  # four Trainer compiles (~35 s idle); test_flexformer's mesh test is the fast one
def test_flexformer_n_mesh_spread_within_k_times_softmax():
    """With the default features, sharding changes flexformer_n's loss no more than
    softmax's (up to a factor and the rounding floor; the raw map, qk_radius=None,
    amplify it). Tiny encoder, 1 device vs a (2, 4) mesh (measured: 1.2e-7 vs 2.4e-7)."""
    from test_train import tiny_config, toy_task

    assert jax.device_count() >= 8, "conftest fakes 8 CPU devices"
    config = tiny_config("softmax")
    config.learning_rate = 1e-2
    config.model.num_layers = 1
    res = ba.stability(config, ("flexformer_n", "softmax"), steps=4, seeds=(0,),
                       meshes=((1, 1), (2, 4)), data=toy_task())  # fmt: skip
    flex, soft = (ba.spread(res[n]["meshes"])[1] for n in ("flexformer_n", "softmax"))
    print(f"mesh max-min: flexformer_n {flex:.2e}, softmax {soft:.2e}")
    assert flex <= 10 * max(soft, 1e-6), (flex, soft)


def test_command_runs_the_chosen_sections_in_order_and_writes_the_tables(
    tmp_path, monkeypatch, capsys
):
    """``python -m train.bench_activations``: the sections asked for, in the order asked, with
    their flags; the command line (without ``--out``) heading the text; ``--out`` a copy. The
    sections are stand-ins here (the real ones: the tests above)."""
    from train.bench_activations import __main__ as cli

    calls = []
    monkeypatch.setattr(
        cli, "denominator_section", lambda *a: calls.append(("den", *a)) or ("DEN",)
    )
    monkeypatch.setattr(cli, "stability_section", lambda *a: calls.append(("stab", *a)) or "ST")
    monkeypatch.setattr(cli, "laplacian_section", lambda *a: calls.append(("lap", *a)) or "LAP")
    monkeypatch.setattr(cli, "kernels_section", lambda *a: calls.append(("ker", *a)) or "KER")
    out = tmp_path / "tables.md"
    text = cli.main(
        ["--sections", "kernels,denominators,stability", "--steps", "3", "--examples", "2",
         "--train-den-floor", "0", "--stability-steps", "4", "--out", str(out)]
    )  # fmt: skip
    assert calls == [("ker", 2), ("den", 3, 2, 0.0), ("stab", 4)]
    parts = text.split("\n\n")
    assert parts[0] == (
        "`python -m train.bench_activations --sections kernels,denominators,stability --steps 3"
        " --examples 2 --train-den-floor 0 --stability-steps 4`"
    )
    assert parts[1:4] == ["KER", "DEN", "ST"] and parts[4].endswith("x cpu)")
    assert out.read_text() == text + "\n"
    assert "[kernels] ..." in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"--sections: unknown \['nope'\]"):
        cli.main(["--sections", "laplacian,nope"])
