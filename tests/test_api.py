"""The registry, `Mechanism.bind`, and the bad-input contract (SPEC section 3)."""

import jax
import jax.numpy as jnp
import pytest
from _helpers import init, mech, qkv

import linattn_jax as la

EXPECTED = [
    "softmax",
    "linear_elu",
    "performer",
    "rfa",
    "hedgehog",
    "flexformer_s",
    "flexformer_n",
    "nystromformer",
    "soft",
    "laplacian",
    "ra",
    "lara",
]


def test_names_and_registry():
    names = la.names()
    assert [n for n in EXPECTED if n in names] == names[: len([n for n in EXPECTED if n in names])]
    for n in names:
        m = la.get(n)
        assert m.name == n and isinstance(m.supports_causal, bool)
    assert set(la.causal_names()) == {n for n in names if la.get(n).supports_causal}
    with pytest.raises(KeyError, match="unknown mechanism 'nope'"):
        la.get("nope")


def test_the_documented_call_shape():
    rng = jax.random.key(0)
    q, k, v = qkv()
    m = la.get("performer").bind(num_features=64)
    params = m.init(rng, num_heads=2, head_dim=8)
    assert params["features"].shape == (1, 64, 8)  # shared by the heads (the default)
    out = m.attention(q, k, v, params, rng, mask=None, causal=False, deterministic=False)
    assert out.shape == v.shape


def test_bind_and_defaults():
    m = la.get("performer")
    assert m.defaults["num_features"] == 256 and m.defaults["chunk_size"] == 64
    b = m.bind(num_features=8).bind(chunk_size=4)
    assert b.defaults["num_features"] == 8 and b.defaults["chunk_size"] == 4
    assert init(b)["features"].shape == (1, 8, 8)
    # A call-time value overrides the bound one.
    params = b.init(
        jax.random.key(0), num_heads=2, head_dim=4, num_features=3, shared_features=False
    )
    assert params["features"].shape == (2, 3, 4)
    assert m.config == {}  # bind returns a new mechanism


def test_unknown_config_key_raises_type_error():
    with pytest.raises(TypeError, match=r"'performer'.*\['bogus'\].*accepted keys"):
        la.get("performer").bind(bogus=1)
    q, k, v = qkv()
    with pytest.raises(TypeError, match="num_landmarks"):
        la.get("linear_elu").attention(q, k, v, {}, num_landmarks=3)


def test_unhashable_config_raises():
    with pytest.raises(TypeError, match="hashable"):
        la.get("performer").bind(num_features=[1])


@pytest.mark.parametrize("name", la.names())
def test_config_defaults_agree_between_init_and_attention(name):
    from linattn_jax.registry import _config_params

    m = la.get(name)
    a, b = _config_params(m.init_fn), _config_params(m.attention_fn)
    for key in set(a) & set(b):
        assert a[key] == b[key], (name, key)


# --- bad input: one test per class -------------------------------------------------


@pytest.mark.parametrize("name", la.names())
def test_wrong_rank(name):
    m = mech(name)
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q must have rank 4.*\(2, 12, 16\)"):
        m.attention(q.reshape(2, 12, 16), k, v, init(m), jax.random.key(0))


@pytest.mark.parametrize("name", la.names())
@pytest.mark.parametrize(
    "what,match",
    [("batch", "batch sizes differ"), ("heads", "head counts differ"), ("depth", "depths differ")],
)
def test_mismatched_shapes(name, what, match):
    m = mech(name)
    q, k, v = qkv()
    if what == "batch":
        k = k[:1]
    elif what == "heads":
        k = jnp.concatenate([k, k], axis=2)
    else:
        k = k[..., :4]
    with pytest.raises(ValueError, match=match):
        m.attention(q, k, v, init(m), jax.random.key(0))


def test_mismatched_key_value_length():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k and v lengths differ: k \(2, 12, 2, 8\), v \(2, 5"):
        la.get("linear_elu").attention(q, k, v[:, :5], {})


@pytest.mark.parametrize("name", la.names())
def test_integer_inputs_raise(name):
    m = mech(name)
    q, k, v = qkv()
    with pytest.raises(TypeError, match="floating"):
        m.attention(q.astype(jnp.int32), k, v, init(m), jax.random.key(0))


def test_bad_mask():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"mask must be a key-padding mask \[batch, Tk\]"):
        la.get("softmax").attention(q, k, v, {}, mask=jnp.ones((2, 5), bool))
    with pytest.raises(TypeError, match="mask must be bool"):
        la.get("softmax").attention(q, k, v, {}, mask=jnp.ones((2, 12)))


@pytest.mark.parametrize("name", la.causal_names())
def test_causal_needs_equal_lengths(name):
    m = mech(name)
    q, k, v = qkv(tq=5, tk=12)
    with pytest.raises(ValueError, match="causal=True needs Tq == Tk"):
        m.attention(q, k, v, init(m), jax.random.key(0), causal=True)


@pytest.mark.parametrize("name", [n for n in la.names() if not la.get(n).supports_causal])
def test_causal_unsupported_raises_not_implemented(name):
    m = mech(name)
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match=f"{name} does not support causal.*softmax"):
        m.attention(q, k, v, init(m), jax.random.key(0), causal=True)


def test_errors_raise_under_jit():
    q, k, v = qkv()
    f = jax.jit(lambda q, k, v: la.get("linear_elu").attention(q, k, v, {}))
    with pytest.raises(ValueError, match="depths differ"):
        f(q, k[..., :4], v)


def test_params_shape_mismatch_names_the_param():
    q, k, v = qkv()
    params = init(la.get("hedgehog"), h=3)
    with pytest.raises(ValueError, match=r"params\['w'\] has shape \(3, 8, 8\)"):
        la.get("hedgehog").attention(q, k, v, params)


@pytest.mark.parametrize("name", [n for n in la.names() if init(la.get(n))])
def test_missing_params_is_a_clear_error(name):
    """Calling a mechanism without the params its init makes names the missing key."""
    q, k, v = qkv()
    with pytest.raises(ValueError, match=rf"{name}: params is missing '\w+'; got keys \[\]"):
        la.get(name).attention(q, k, v, {}, jax.random.key(0))


#: Mechanisms with a hand-written VJP on their path (docs/api-contract.md, "Dtypes and
#: numerics"): forward-mode autodiff raises through them.
REVERSE_MODE_ONLY = {"flexformer_s", "soft", "laplacian", "lara"}


@pytest.mark.parametrize("name", la.names())
def test_forward_mode_autodiff_where_the_docs_say(name):
    m = mech(name)
    q = jax.random.normal(jax.random.key(0), (1, 4, 2, 4))
    params = init(m, h=2, d=4)

    def f(x):
        return m.attention(x, x, x, params, jax.random.key(1))

    jvp = jax.jit(lambda q: jax.jvp(f, (q,), (q,)))  # one program, not one per eager op
    if name in REVERSE_MODE_ONLY:
        with pytest.raises(TypeError, match="forward-mode"):
            jvp(q)
    else:
        out, tangent = jvp(q)
        assert out.shape == tangent.shape == q.shape
