"""la.transplant: a flax checkpoint carried into our modules, exactly; mismatches refused."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.core import FrozenDict

import linattn_jax as la
from train import distill

B, T, F, H = 2, 5, 8, 2


def _x(seed=0):
    return jax.random.normal(jax.random.key(seed), (B, T, F))


def _flax_mhdpa():
    layer = nn.MultiHeadDotProductAttention(num_heads=H)
    return layer, layer.init(jax.random.key(1), _x())


def test_flax_mhdpa_into_the_softmax_module_is_exact():
    theirs, source = _flax_mhdpa()
    ours = la.linen.MultiHeadAttention(num_heads=H, attention="softmax")
    target = ours.init({"params": jax.random.key(2)}, _x())
    variables = la.transplant(source, target)
    want = theirs.apply(source, _x(3))
    got = ours.apply(variables, _x(3))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)
    # the untransplanted module is another function: the check can fail
    assert np.max(np.abs(np.asarray(ours.apply(target, _x(3)) - want))) > 1e-2


def test_nnx_state_into_the_nnx_softmax_module_is_exact():
    theirs = nnx.MultiHeadAttention(
        num_heads=H, in_features=F, decode=False, deterministic=True, rngs=nnx.Rngs(1)
    )
    ours = la.nn.MultiHeadAttention(H, F, attention="softmax", rngs=nnx.Rngs(2))
    before = ours(_x(3))
    state = la.transplant(nnx.state(theirs, nnx.Param), nnx.state(ours))
    assert isinstance(state, nnx.State)
    nnx.update(ours, state)
    want = theirs(_x(3))
    np.testing.assert_allclose(np.asarray(ours(_x(3))), np.asarray(want), atol=1e-6, rtol=0)
    assert np.max(np.abs(np.asarray(before - want))) > 1e-2


def test_mechanism_params_are_kept_and_listed():
    _, source = _flax_mhdpa()
    ours = la.linen.MultiHeadAttention(
        num_heads=H, attention="flexformer_n", attention_config=(("num_features", 4),)
    )
    target = ours.init({"params": jax.random.key(2)}, _x())
    variables, kept = la.transplant(source, target, return_kept=True)
    params = nn.meta.unbox(variables)["params"]
    src = source["params"]
    for name in ("query", "key", "value", "out"):
        for leaf in ("kernel", "bias"):
            np.testing.assert_array_equal(params[name][leaf], src[name][leaf])
    mech = nn.meta.unbox(target)["params"]["mechanism"]
    assert kept == sorted(("params", "mechanism", n) for n in mech)
    for n in mech:
        np.testing.assert_array_equal(params["mechanism"][n], mech[n])


def test_containers_and_boxes_are_the_targets():
    box = nn.Partitioned(jnp.zeros((3,)), names=("embed",))
    target = FrozenDict({"params": {"w": box, "fresh": jnp.ones((2,))}})
    out, kept = la.transplant({"params": {"w": jnp.arange(3.0)}}, target, return_kept=True)
    assert isinstance(out, FrozenDict)
    assert isinstance(out["params"]["w"], nn.Partitioned)
    assert out["params"]["w"].names == ("embed",)
    np.testing.assert_array_equal(out["params"]["w"].value, np.arange(3.0))
    assert kept == [("params", "fresh")]


def test_every_mismatch_is_listed():
    _, source = _flax_mhdpa()
    params = dict(source["params"])
    params["extra"] = {"w": jnp.zeros((3,))}  # no destination
    params["out"] = dict(params["out"], bias=jnp.zeros((F + 1,)))  # shape
    params["query"] = dict(params["query"], bias=params["query"]["bias"].astype(jnp.bfloat16))
    ours = la.linen.MultiHeadAttention(num_heads=H, attention="softmax")
    target = ours.init({"params": jax.random.key(2)}, _x())
    with pytest.raises(ValueError) as err:
        la.transplant({"params": params}, target)
    msg = str(err.value)
    assert "1 source leaves have no destination" in msg and "params/extra/w" in msg
    assert "2 source leaves differ" in msg
    assert f"params/out/bias: source ({F + 1},) float32, target ({F},) float32" in msg
    assert "params/query/bias: source (2, 4) bfloat16, target (2, 4) float32" in msg
    # params without their collection: every leaf is listed, nothing is half-copied
    with pytest.raises(ValueError, match="8 source leaves have no destination"):
        la.transplant(source["params"], target)
    # skip drops a subtree of the source
    out = la.transplant({"params": params}, target, skip=("extra", "out", "query"))
    np.testing.assert_array_equal(
        nn.meta.unbox(out)["params"]["key"]["kernel"], source["params"]["key"]["kernel"]
    )


def test_distill_transplant_raises_when_names_do_not_match():
    _, source = _flax_mhdpa()
    ours = la.linen.MultiHeadAttention(num_heads=H, attention="softmax")
    target = ours.init({"params": jax.random.key(2)}, _x())
    renamed = {"params": {f"{k}_proj": v for k, v in source["params"].items()}}
    with pytest.raises(ValueError, match="params/query_proj/kernel"):
        distill.transplant(renamed, target)
    merged, copied, kept = distill.transplant(source, target)
    assert len(copied) == 8 and ("params", "out", "kernel") in copied
    assert all(p not in copied for p in kept)
