"""Flax NNX and Linen modules for every mechanism."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import SMALL_CONFIG, max_rel_err
from flax import nnx

import linattn_jax as la
from linattn_jax import flexformer
from linattn_jax import linen as la_linen
from linattn_jax import nn as la_nn

F, H = 16, 4  # width, heads -> head_dim 4
D = F // H

# Trainable mechanism params per mechanism, as documented in each module (M = num_features).
MECH_PARAMS = {
    "softmax": 0,
    "linear_elu": 0,
    "performer": 0,  # features are fixed, not trained
    "rfa": H * D,  # sigma
    "hedgehog": 2 * (H * D * D + H * D),  # query and key maps
    "flexformer_s": H * 32 * D + H,  # omega, log_scale
    "flexformer_n": 2 * H * 32 * D + H,  # omega1, omega2, tau
}


def _x(t=10, seed=0):
    return jax.random.normal(jax.random.key(seed), (2, t, F))


def _head_axes(mech):
    """``{param: [axes whose size follows the head count]}``, from H and H + 1 heads."""

    def shapes(h):
        fn = lambda r: mech.init(r, num_heads=h, head_dim=D)  # noqa: E731
        return jax.tree.map(jnp.shape, jax.eval_shape(fn, jax.random.key(0)))

    a, b = shapes(H), shapes(H + 1)
    return {k: [i for i, (x, y) in enumerate(zip(a[k], b[k])) if x != y] for k in a}


def _count(tree):
    return sum(x.size for x in jax.tree_util.tree_leaves(tree))


@pytest.mark.parametrize("name", la.names())
def test_nnx_init_apply(name):
    causal = la.get(name).supports_causal
    layer = la_nn.MultiHeadAttention(
        H, F, attention=name, attention_config=SMALL_CONFIG.get(name), rngs=nnx.Rngs(0, attention=1)
    )
    mask = jnp.ones((2, 10), bool).at[1, 7:].set(False)
    y = layer(_x(), mask=mask, causal=causal)
    assert y.shape == (2, 10, F) and jnp.all(jnp.isfinite(y))
    n = _count(nnx.state(layer, nnx.Param))
    projections = 4 * (F * F + F)
    mech_trainable = _count(
        {k: v for k, v in layer.mechanism_params().items() if k not in layer.mech.fixed_params()}
    )
    assert n == projections + mech_trainable
    if name in MECH_PARAMS:
        assert mech_trainable == MECH_PARAMS[name]
    wider = _head_axes(layer.mech)
    for key, var in (layer.mechanism or {}).items():  # the head axis is named "heads"
        names = var.get_metadata().get("out_sharding") or ()
        assert [i for i, n in enumerate(names) if n == "heads"] == wider[key], (key, names)
    fixed = nnx.state(layer, la_nn.FixedFeatures)
    assert {k for k, _ in jax.tree_util.tree_flatten_with_path(fixed)[0]} or not (
        layer.mech.fixed_params()
    )


@pytest.mark.parametrize("name", la.names())
def test_linen_init_apply(name):
    causal = la.get(name).supports_causal
    layer = la_linen.MultiHeadAttention(
        num_heads=H, attention=name, attention_config=tuple(SMALL_CONFIG.get(name, {}).items())
    )
    x = _x()
    variables = layer.init({"params": jax.random.key(0), "attention": jax.random.key(1)}, x)
    y = layer.apply(variables, x, causal=causal, rngs={"attention": jax.random.key(2)})
    assert y.shape == (2, 10, F) and jnp.all(jnp.isfinite(y))
    n = _count(variables["params"])
    mech_trainable = _count(variables["params"].get("mechanism", {}))
    # no empty dicts: a mechanism without trainable params makes no ``mechanism`` entry
    assert ("mechanism" in variables["params"]) == (mech_trainable > 0)
    assert n == 4 * (F * F + F) + mech_trainable
    if name in MECH_PARAMS:
        assert mech_trainable == MECH_PARAMS[name]
    assert set(variables.get("fixed", {}).get("mechanism", {})) == set(
        la.get(name).bind(**SMALL_CONFIG.get(name, {})).fixed_params()
    )
    specs = nn.get_partition_spec(variables)["params"]
    assert tuple(specs["query"]["kernel"]) == ("embed", "heads", "kv")
    assert tuple(specs["out"]["kernel"]) == ("heads", "kv", "embed")
    # the head axis of every mechanism param that has one is named "heads"
    wider = _head_axes(la.get(name).bind(**SMALL_CONFIG.get(name, {})))
    for key in variables["params"].get("mechanism", {}):
        spec = tuple(specs["mechanism"][key])
        assert [i for i, n in enumerate(spec) if n == "heads"] == wider[key], (key, spec)


def test_nnx_attention_stream_changes_performer_only_when_stochastic():
    layer = la_nn.MultiHeadAttention(
        H,
        F,
        attention="performer",
        attention_config={"num_features": 16, "redraw": "call"},
        rngs=nnx.Rngs(0, attention=1),
    )
    x = _x()
    a, b = layer(x, deterministic=False), layer(x, deterministic=False)
    assert not np.allclose(a, b)  # the stream advances between calls: fresh features
    d1, d2 = layer(x, deterministic=True), layer(x, deterministic=True)
    np.testing.assert_array_equal(d1, d2)
    np.testing.assert_array_equal(layer(x), d1)  # flax's default: deterministic, no rng
    # An explicit key reproduces a call.
    np.testing.assert_array_equal(
        layer(x, deterministic=False, rngs=jax.random.key(5)),
        layer(x, deterministic=False, rngs=jax.random.key(5)),
    )
    bare = la_nn.MultiHeadAttention(H, F, attention="ra", rngs=nnx.Rngs(params=0), keep_rngs=False)
    with pytest.raises(ValueError, match="needs an rng"):
        bare(x, deterministic=False)


def test_nnx_redraw_replaces_fixed_features():
    layer = la_nn.MultiHeadAttention(
        H, F, attention="performer", attention_config={"num_features": 16}, rngs=nnx.Rngs(0)
    )
    x = _x()
    before = layer(x, deterministic=True)
    old = layer.mechanism["features"][...]
    layer.redraw(jax.random.key(9))
    assert not np.allclose(old, layer.mechanism["features"][...])
    assert not np.allclose(before, layer(x, deterministic=True))


def test_linen_attention_stream():
    layer = la_linen.MultiHeadAttention(
        num_heads=H,
        attention="performer",
        attention_config=(("num_features", 16), ("redraw", "call")),
    )
    x = _x()
    v = layer.init({"params": jax.random.key(0)}, x, deterministic=True)
    a = layer.apply(v, x, deterministic=False, rngs={"attention": jax.random.key(1)})
    b = layer.apply(v, x, deterministic=False, rngs={"attention": jax.random.key(2)})
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(layer.apply(v, x), layer.apply(v, x, deterministic=True))
    with pytest.raises(ValueError, match="'attention' rng stream"):
        layer.apply(v, x, deterministic=False)
    d1 = layer.apply(v, x, deterministic=True, rngs={"attention": jax.random.key(1)})
    d2 = layer.apply(v, x, deterministic=True, rngs={"attention": jax.random.key(2)})
    np.testing.assert_array_equal(d1, d2)


@pytest.mark.parametrize("name", [n for n in ("flexformer_s", "flexformer_n") if n in la.names()])
def test_gradients_reach_spectral_params_through_module(name):
    layer = la_linen.MultiHeadAttention(
        num_heads=H, attention=name, attention_config=(("num_features", 8),)
    )
    x = _x()
    v = jax.jit(layer.init)({"params": jax.random.key(0)}, x)
    # jitted: eager op-by-op dispatch compiles each primitive on its own (measured 2-4x slower)
    g = jax.jit(jax.grad(lambda p: jnp.sum(layer.apply({"params": p}, x, causal=True) ** 2)))(
        v["params"]
    )
    for key, val in nn.meta.unbox(g)["mechanism"].items():
        assert jnp.all(jnp.isfinite(val)) and jnp.any(val != 0), key

    model = la_nn.MultiHeadAttention(
        H, F, attention=name, attention_config={"num_features": 8}, rngs=nnx.Rngs(0)
    )
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))(model)
    for key, val in grads["mechanism"].items():
        assert jnp.any(val[...] != 0), key


# bfloat16 has an 8-bit significand: one rounding is <= 2^-8 relative. Projections, the
# mechanism's float32 internals and the output projection compound a few of those, so for
# mechanisms whose weights are positive (a convex combination of values) the bf16-compute
# output must be within 8 ulp (relative to the output's scale) of float32, and, since the
# flag must take effect, not equal to it (measured: 0.5%-0.7%). Trigonometric features
# (flexformer, rfa) and laplacian's Newton-Schulz inverse can have small denominators /
# ill-conditioned landmark matrices at init, which amplify the rounding of q and k (measured
# with nnx seeds 0-2: flexformer_n 5%-117%, laplacian 4%-8%): for those only the dtypes and
# finiteness are checked here.
BF16_ULP = 2.0**-8


@pytest.mark.parametrize(
    "name", ["softmax", "performer", "hedgehog", "lara", "flexformer_n", "laplacian"]
)
def test_bfloat16_compute_dtype(name):
    x = _x()
    lin = la_linen.MultiHeadAttention(num_heads=H, attention=name, deterministic=True)
    variables = lin.init({"params": jax.random.key(1)}, x)
    want = lin.apply(variables, x)
    got = lin.clone(dtype=jnp.bfloat16).apply(variables, x)
    assert got.dtype == jnp.bfloat16
    assert {leaf.dtype for leaf in jax.tree.leaves(variables)} == {jnp.dtype(jnp.float32)}
    _check_close(got, want, name)
    # nnx: the same module, the same bound
    kw = dict(attention=name, deterministic=True, rngs=nnx.Rngs(params=0))
    m32 = la_nn.MultiHeadAttention(H, F, **kw)
    m16 = la_nn.MultiHeadAttention(H, F, dtype=jnp.bfloat16, **kw)
    nnx.update(m16, nnx.state(m32))
    want, got = m32(x), m16(x)
    assert got.dtype == jnp.bfloat16 and m16.query.kernel[...].dtype == jnp.float32
    _check_close(got, want, name)


def _check_close(got, want, name):
    assert bool(jnp.all(jnp.isfinite(got)))
    err = max_rel_err(got, want)
    assert err > 1e-4, err  # bf16 was used
    if name not in ("flexformer_n", "laplacian"):
        assert err < 8 * BF16_ULP, err


@pytest.mark.parametrize(
    ("name", "extra"), [("performer", {}), ("softmax", {}), ("flexformer_n", {"den_floor": 0.9})]
)
def test_linen_decode_mode_equals_parallel_causal(name, extra):
    """``decode=True``: one token per call with the ``cache`` collection gives the parallel
    causal layer's outputs (performer: the recurrent state of its feature map; softmax: a KV
    cache; flexformer_n with a denominator floor that is active on most rows: the state's
    mass channel), with the same parameters."""
    config = tuple({**SMALL_CONFIG.get(name, {}), **extra}.items())
    kw = dict(num_heads=H, attention=name, attention_config=config, deterministic=True)
    x = _x(t=6)
    variables = la_linen.MultiHeadAttention(**kw).init(jax.random.key(0), x)
    want = la_linen.MultiHeadAttention(**kw).apply(variables, x, causal=True)
    dec = la_linen.MultiHeadAttention(**kw, decode=True, max_len=6)
    cache = dec.init(jax.random.key(0), x[:, :1])["cache"]
    outs = []
    for i in range(6):
        y, upd = dec.apply({**variables, "cache": cache}, x[:, i : i + 1], mutable=["cache"])
        cache = upd["cache"]
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), want, rtol=1e-4, atol=1e-5)
    state_shapes = {leaf.shape for leaf in jax.tree.leaves(cache)}
    assert any(6 in s for s in state_shapes) == (la.get(name).feature_map is None)
    with pytest.raises(ValueError, match="one token"):
        dec.apply({**variables, "cache": cache}, x[:, :2], mutable=["cache"])
    if la.get(name).feature_map is None:
        with pytest.raises(ValueError, match="needs max_len >= 1"):
            la_linen.MultiHeadAttention(**kw, decode=True).init(jax.random.key(0), x[:, :1])


def test_nnx_decode_equals_parallel_causal():
    """NNX decoding as in flax (``init_cache`` then one token per ``decode=True`` call): the
    feature map's recurrent state (performer) and the KV cache (softmax) reproduce the
    parallel causal layer; a full KV cache gives NaN, not a silently overwritten prefix."""
    x = _x(t=5)
    for name in ("performer", "softmax"):
        kw = dict(attention=name, attention_config=SMALL_CONFIG.get(name), rngs=nnx.Rngs(0))
        layer = la_nn.MultiHeadAttention(H, F, **kw)
        want = layer(x, causal=True)
        with pytest.raises(ValueError, match="init_cache"):
            layer(x[:, :1], decode=True)
        layer.init_cache(x.shape)
        got = jnp.concatenate([layer(x[:, i : i + 1], decode=True) for i in range(5)], 1)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        with pytest.raises(ValueError, match="one token"):
            layer(x[:, :2], decode=True)
    assert bool(jnp.all(jnp.isnan(layer(x[:, :1], decode=True))))  # softmax: cache full


def test_linen_decode_cache_from_full_length_input():
    """Flax's convention: the cache is created by ``init`` on the full-length input."""
    kw = dict(num_heads=H, attention="softmax")
    x = _x(t=4)
    variables = la_linen.MultiHeadAttention(**kw).init(jax.random.key(0), x)
    want = la_linen.MultiHeadAttention(**kw).apply(variables, x, causal=True)
    dec = la_linen.MultiHeadAttention(**kw, decode=True)
    cache = dec.init(jax.random.key(0), x)["cache"]
    outs = []
    for i in range(4):
        y, upd = dec.apply({**variables, "cache": cache}, x[:, i : i + 1], mutable=["cache"])
        cache = upd["cache"]
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), want, rtol=1e-5, atol=1e-6)


def test_flax_arguments_and_param_names():
    """Flax's constructor arguments are honoured (params named as flax names them), and what
    a mechanism cannot do raises naming the argument."""
    x, xk = _x(t=4), _x(t=6, seed=1)
    kw = dict(num_heads=H, normalize_qk=True, use_bias=False, kernel_init=nn.initializers.ones)
    theirs = nn.MultiHeadDotProductAttention(**kw).init(jax.random.key(0), x, xk)
    ours_mod = la_linen.MultiHeadAttention(**kw, attention="linear_elu")
    ours = ours_mod.init(jax.random.key(0), x, xk)
    shapes = lambda t: jax.tree.map(jnp.shape, nn.meta.unbox(t))  # noqa: E731
    assert shapes(ours["params"]) == shapes(theirs["params"])
    assert set(ours["params"]) == {"query", "key", "value", "out", "query_ln", "key_ln"}
    assert bool(jnp.all(ours["params"]["query"]["kernel"] == 1.0))  # kernel_init used
    assert ours_mod.apply(ours, x, xk).shape == x.shape  # cross attention
    with pytest.raises(ValueError, match="sow_weights"):
        ours_mod.apply(ours, x, sow_weights=True)
    # The message reads the records: the mechanisms that do apply attention dropout.
    with pytest.raises(ValueError, match=r"dropout_rate.*apply it: \['softmax', 'ra'\]"):
        ours_mod.clone(dropout_rate=0.1).apply(ours, x, deterministic=True)
    with pytest.raises(ValueError, match="attention_fn"):
        ours_mod.clone(attention_fn=nn.dot_product_attention).apply(ours, x)
    soft = la_linen.MultiHeadAttention(num_heads=H)
    v = soft.init(jax.random.key(0), x)
    _, state = soft.apply(v, x, sow_weights=True, mutable=["intermediates"])
    assert state["intermediates"]["attention_weights"][0].shape == (2, H, 4, 4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        la_nn.MultiHeadAttention(H, F, num_kv_heads=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="deterministic"):  # flax: dropout needs the flag
        la_nn.MultiHeadAttention(H, F, dropout_rate=0.1, rngs=nnx.Rngs(0))(x)


def test_mechanism_params_drawn_together_keep_their_relation():
    """Every mechanism param of a layer comes from one ``mech.init`` call: linen's
    params equal ``mech.init`` with one rng, so flexformer_n's pairs start 0.1-jittered
    copies (drawn one by one, they were independent and the kernel non-stationary at init)."""
    layer = la_linen.MultiHeadAttention(num_heads=2, attention="flexformer_n")
    x = jnp.ones((1, 4, 16))
    got = nn.meta.unbox(layer.init(jax.random.key(0), x)["params"]["mechanism"])
    w1, w2 = flexformer.frequencies(got)
    assert 0.05 < float(jnp.std(w2 - w1)) < 0.2 < float(jnp.std(w1))
    nnx_layer = la_nn.MultiHeadAttention(2, 16, attention="flexformer_n", rngs=nnx.Rngs(0))
    m = nnx_layer.mechanism
    w1, w2 = flexformer.frequencies({k: m[k][...] for k in ("omega1_tilde", "omega2_tilde", "tau")})
    assert 0.05 < float(jnp.std(w2 - w1)) < 0.2
