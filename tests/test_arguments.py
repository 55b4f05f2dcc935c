"""Every bad argument is a named error: params of the wrong kind, an rng that is not a key,
a config value contradicting the params, a non-positive size (at `bind`, `init` or call
time), and a device list where `sequence_parallel` takes a mesh. Each message names the
argument, what it got and what is accepted."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import init, mech, qkv
from jax.sharding import Mesh

import linattn_jax as la
from linattn_jax import registry

# mechanisms whose init makes params (the others ignore params)
WITH_PARAMS = [n for n in la.names() if init(mech(n))]
STOCHASTIC = [n for n in la.names() if la.get(n).stochastic]
# mechanisms whose params' shapes fix num_features (an init-only key)
NUM_FEATURES = ["performer", "rfa", "flexformer_s", "flexformer_n"]


@pytest.mark.parametrize("name", WITH_PARAMS)
@pytest.mark.parametrize("params", [None, [1, 2]], ids=["None", "list"])
def test_params_of_the_wrong_kind_is_a_type_error(name, params):
    q, k, v = qkv(b=1, tq=4, tk=4)
    with pytest.raises(TypeError, match=rf"{name}: params must be the dict .*got"):
        mech(name).attention(q, k, v, params, jax.random.key(0))


@pytest.mark.parametrize("name", STOCHASTIC)
@pytest.mark.parametrize(
    "rng,got", [(0, "int 0"), (jnp.zeros(2), "float32"), ("seed", "str 'seed'")]
)
def test_rng_that_is_not_a_key_is_a_type_error(name, rng, got):
    m = mech(name)
    q, k, v = qkv(b=1, tq=4, tk=4)
    with pytest.raises(TypeError, match=rf"{name}: rng must be a jax.random.key.*got .*{got}"):
        m.attention(q, k, v, init(m), rng)


def test_legacy_and_typed_keys_are_accepted():
    m = mech("rfa", num_features=4)
    q, k, v = qkv(b=1, tq=4, tk=4)
    params = init(m)
    typed = m.attention(q, k, v, params, jax.random.key(3))
    legacy = m.attention(q, k, v, params, jax.random.PRNGKey(3))
    np.testing.assert_array_equal(typed, legacy)  # the same draws
    # the rng is not read when deterministic: anything goes there
    assert m.attention(q, k, v, params, 0, deterministic=True).shape == q.shape


@pytest.mark.parametrize("name", NUM_FEATURES)
def test_num_features_contradicting_the_params_is_a_value_error(name):
    q, k, v = qkv(b=1, tq=4, tk=4)
    params = init(mech(name, num_features=8))
    ok = jax.eval_shape(
        lambda: mech(name, num_features=8).attention(q, k, v, params, jax.random.key(0))
    )
    assert ok.shape == q.shape
    msg = rf"{name}'?: num_features=16 \(passed at call time\) contradicts params made with "
    with pytest.raises(ValueError, match=msg + r"num_features=8 \(param shapes \{.*8, 8\)"):
        mech(name).attention(q, k, v, params, jax.random.key(0), num_features=16)
    with pytest.raises(ValueError, match=r"num_features=16 \(bound\) contradicts"):
        mech(name, num_features=16).attention(q, k, v, params, jax.random.key(0))
    with pytest.raises(ValueError, match=r"num_features=16 \(bound\) contradicts"):
        mech(name, num_features=16).reference(q, k, v, params, jax.random.key(0))


def _size_cases():
    for name in la.names():
        for key in sorted(registry.SIZE_KEYS & set(la.get(name).defaults)):
            yield name, key


@pytest.mark.parametrize("name,key", list(_size_cases()))
@pytest.mark.parametrize("value", [0, -5, 2.0, True], ids=["0", "-5", "float", "bool"])
def test_non_positive_size_is_a_value_error_at_bind(name, key, value):
    with pytest.raises(ValueError, match=rf"{key} must be an int >= 1, got {value!r}"):
        la.get(name).bind(**{key: value})


def test_non_positive_size_at_init_or_call_time_is_a_value_error():
    q, k, v = qkv(b=1, tq=4, tk=4)
    with pytest.raises(ValueError, match=r"num_samples must be an int >= 1, got -1"):
        la.get("ra").attention(q, k, v, {}, jax.random.key(0), num_samples=-1)
    for name in ("performer", "rfa"):
        with pytest.raises(ValueError, match=r"num_features must be an int >= 1, got 0"):
            la.get(name).init(jax.random.key(0), num_heads=2, head_dim=8, num_features=0)
    with pytest.raises(ValueError, match=r"chunk_size must be an int >= 1, got 0"):
        mech("linear_elu").attention(q, k, v, {}, jax.random.key(0), chunk_size=0)


def test_sequence_parallel_takes_a_mesh_not_a_device_list():
    devices = jax.devices()[:2]
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh, got list of 2"):
        la.parallel.sequence_parallel(la.get("performer"), devices)
    with pytest.raises(TypeError, match=r"mechanism must be a registry Mechanism.*str"):
        la.parallel.sequence_parallel("performer", Mesh(np.array(devices), ("seq",)))
