"""Sequence parallelism (`linattn_jax.parallel`): sharded along T == one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import init, mech
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import linattn_jax as la
from linattn_jax import parallel

_CAUSAL = {n: (False, True) if la.get(n).supports_causal else (False,) for n in la.names()}
_CASES = [(n, {}, c) for n in parallel.supported_names() for c in _CAUSAL[n]]
_CASES.append(("rfa", {"gate": True}, True))
# Chunks of 3 over 4 tokens per device: the padded tail of each device's key summary must
# neither decay the state (rfa's gate) nor count as keys.
_CASES.append(("rfa", {"gate": True, "chunk_size": 3}, True))
# A denominator floor active on most rows: its mass channel crosses the devices too.
_CASES += [("flexformer_n", {"den_floor": 0.9}, c) for c in (False, True)]
# The positive maps: key log-scales (the per-token max) across the devices, no floor.
_CASES += [("flexformer_n", {"features": "positive"}, c) for c in (False, True)]
_CASES.append(("flexformer_s", {"features": "positive"}, True))
# Landmark segments split by the device boundaries (3 per 16 tokens); query landmarks and
# row normalisation; laplacian's local branch over 5 taps (a halo of 2 rows).
_CASES += [
    ("nystromformer", {"num_landmarks": 3}, False),
    ("soft", {"num_landmarks": 3, "normalize": "row"}, False),
    ("laplacian", {"num_landmarks": 3, "shared_landmarks": False, "local_window": 5}, False),
    ("laplacian", {"normalize": "row", "lam": 4.0, "local_window": 0}, False),
    ("laplacian", {"normalize": "uncentered", "num_landmarks": 3, "local_window": 0}, False),
    ("laplacian", {"kernel": "gaussian", "num_landmarks": 3}, False),
    # LARA: split segments, a proposal network, several antithetic draws per proposal.
    (
        "lara",
        {"num_landmarks": 3, "proposal": "adaptive-1d", "num_samples": 2, "antithetic": True},
        False,
    ),
]
# Gradients on the cases that exercise each part of the combination: key log-scales
# (performer, causal), decays (rfa's gate), the all-reduce (non-causal).
# nystromformer: the key softmax over devices; laplacian: landmarks, whitening, the local
# branch's halo and the params (lambda, filters).
_GRAD_CASES = [("performer", {}, True), ("rfa", {"gate": True}, True), ("hedgehog", {}, False)]
# The sharded causal pass of every token-wise map (features inside its scans, the key
# summary's chunks recomputed in the backward pass); padded chunks; the floor's mass channel.
_GRAD_CASES += [(n, {}, True) for n in ("linear_elu", "hedgehog", "flexformer_s")]
_GRAD_CASES += [("rfa", {"gate": True, "chunk_size": 3}, True)]
_GRAD_CASES += [("flexformer_n", {"den_floor": 0.9}, True)]
_GRAD_CASES += [
    ("nystromformer", {"num_landmarks": 3}, False),
    ("laplacian", {"num_landmarks": 3, "local_window": 5}, False),
    ("lara", {"num_landmarks": 3, "proposal": "adaptive-1d"}, False),
]


def _mesh(data=2, seq=4):
    return Mesh(np.array(jax.devices()[: data * seq]).reshape(data, seq), ("data", "seq"))


def _setup(name, config, causal, t=16, b=2, h=2, d=8):
    chunk = {"chunk_size": 2} if la.get(name).feature_map is not None else {}
    m = mech(name, **{**chunk, **config})
    params = init(m)
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (b, t, h, d)) for kk in ks)
    mask = jnp.arange(t)[None, :] < jnp.array([[t], [t - 5]])  # the last shard partly padded
    mesh = _mesh()
    attend = parallel.sequence_parallel(m, mesh, "seq")
    rng = jax.random.key(7)
    kw = dict(mask=mask, causal=causal, deterministic=False)
    sharded = NamedSharding(mesh, PartitionSpec("data", "seq"))
    qkv_s = tuple(jax.device_put(x, sharded) for x in (q, k, v))
    return m, params, (q, k, v), qkv_s, attend, rng, kw


@pytest.mark.parametrize(
    ("m", "masked", "grid"),
    [(4, False, None), (5, False, None), (6, True, None), (20, True, None), (4, True, (3, 5))],
)
def test_sharded_landmarks_equal_one_device(m, masked, grid):
    """The segments of the whole sequence from per-device sums: aligned and split segments,
    mask-dependent segments, more slots than valid tokens, 2-D pooling."""
    from linattn_jax import landmarks as lm

    x = jax.random.normal(jax.random.key(0), (2, 16, 2, 3))
    mask = jnp.arange(16)[None, :] < jnp.array([[16], [11]]) if masked else None
    want = jax.jit(lambda x, mask: lm.landmarks(x, m, mask=mask, grid=grid))(x, mask)
    spec = PartitionSpec("data", "seq")
    args, specs = (x,), (spec,)
    if masked:
        args, specs = (x, mask), (spec, spec)
    got = jax.jit(  # one program, not one per eager op
        jax.shard_map(
            lambda x, mask=None: lm.sharded_landmarks(x, m, "seq", mask=mask, grid=grid),
            mesh=_mesh(),
            in_specs=specs,
            out_specs=PartitionSpec("data"),
            check_vma=False,
        )
    )(*args)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def _assert_equal_one_device(m, params, qkv, qkv_s, attend, rng, kw):
    got = jax.jit(lambda q, k, v, p: attend(q, k, v, p, rng, **kw))(*qkv_s, params)
    want = jax.jit(lambda q, k, v, p: m.attention(q, k, v, p, rng, **kw))(*qkv, params)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-5)
    assert tuple(got.sharding.spec)[:2] == ("data", "seq")  # the output stays sharded


@pytest.mark.parametrize(("name", "config", "causal"), _CASES, ids=str)
def test_sequence_parallel_equals_one_device(name, config, causal):
    _assert_equal_one_device(*_setup(name, config, causal))


@pytest.mark.parametrize(
    ("name", "deterministic"), [("lara", False), ("lara", True), ("laplacian", False)]
)
def test_sequence_parallel_without_mask(name, deterministic):
    """The unmasked paths (LARA's and laplacian's whitening are separate code) and LARA
    without draws."""
    m, params, qkv, qkv_s, attend, rng, kw = _setup(name, {"num_landmarks": 3}, False)
    kw.update(mask=None, deterministic=deterministic)
    _assert_equal_one_device(m, params, qkv, qkv_s, attend, rng, kw)


@pytest.mark.parametrize(("name", "config", "causal"), _GRAD_CASES, ids=str)
def test_sequence_parallel_gradients_equal_one_device(name, config, causal):
    m, params, qkv, qkv_s, attend, rng, kw = _setup(name, config, causal)

    def loss(fn, q, k, v, p):
        return jnp.sum(jnp.sin(fn(q, k, v, p, rng, **kw)))

    g = jax.jit(jax.grad(lambda *a: loss(attend, *a), argnums=(0, 1, 2, 3)))(*qkv_s, params)
    g0 = jax.jit(jax.grad(lambda *a: loss(m.attention, *a), argnums=(0, 1, 2, 3)))(*qkv, params)
    for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(g0), strict=True):
        scale = float(jnp.max(jnp.abs(y))) + 1e-6
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-3, atol=1e-4 * scale)


def test_bad_meshes_and_mechanisms_raise():
    m = mech("linear_elu")
    q, k, v = jnp.ones((3, 2, 10, 2, 8))
    with pytest.raises(ValueError, match="no sequence axis 'seq'"):
        parallel.sequence_parallel(m, Mesh(np.array(jax.devices()[:2]), ("data",)))
    attend = parallel.sequence_parallel(m, _mesh())
    with pytest.raises(ValueError, match=r"T divisible by the 4 devices of mesh axis 'seq'"):
        attend(q, k, v, {})
    with pytest.raises(NotImplementedError, match="'softmax' is not one of them"):
        parallel.sequence_parallel(la.get("softmax"), _mesh())
    with pytest.raises(NotImplementedError, match=r"grid=\(2, 4\) \(2-D landmarks\)"):
        parallel.sequence_parallel(mech("soft", grid=(2, 4)), _mesh())(
            q[:, :8], k[:, :8], v[:, :8], {}
        )
    with pytest.raises(ValueError, match="causal"):  # the mechanism's own checks still apply
        attend(q[:, :8], k, v, {}, causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_per_device_memory_falls_with_the_shards(causal):
    """XLA's compiled per-device memory (forward+backward) over 4 sequence shards grows
    with the length at close to a quarter of one device's rate (`python -m train.bench
    parallel` reports the memory itself at 64k). The growth, from T = 4k to 8k: one device's
    non-causal pass over a long sequence holds one block's features whatever T
    (`core.attend_features`), a constant that at these small shapes is most of its memory."""
    from train.bench.parallel import per_device_memory

    def growth(shards):
        mem = [
            per_device_memory("performer", t, shards, causal=causal, h=2, d=16)
            for t in (4096, 8192)
        ]
        return mem[1] - mem[0]

    one, four = growth(1), growth(4)
    assert 0 < four < 0.35 * one, (one, four)


_TOKEN_WISE = [
    n
    for n in parallel.supported_names()
    if la.get(n).feature_map is not None and la.get(n).supports_causal
]


@pytest.mark.parametrize("name", _TOKEN_WISE)
def test_sharded_causal_forward_holds_no_block_of_features(name):
    """The sharded causal pass computes its features inside its scans: its forward pass over
    4 shards holds about a quarter of one device's memory (which never holds the whole
    sequence's features either), not a device's ``[B, T/4, H, M]`` query and key features
    (M = 16-256 against d = 16; the pass that held them: 0.43 of one device's for
    linear_elu, 3.0 for performer, 3.5 for flexformer_n). Compiled, not run: T = 16k costs
    what a short sequence does."""
    from train.bench.parallel import per_device_memory

    assert la.get(name).feature_map.token_wise
    one = per_device_memory(name, 16384, 1, causal=True, h=2, d=16, backward=False)
    four = per_device_memory(name, 16384, 4, causal=True, h=2, d=16, backward=False)
    assert four < 0.35 * one, (one, four)


def test_linen_and_nnx_modules_run_sequence_parallel_under_jit():
    """``mesh=`` runs a module's attention through `sequence_parallel`: the same output as
    without, under jit, with the same params, on a (data=2, seq=4) mesh."""
    from flax import nnx

    mesh = _mesh()
    x = jax.random.normal(jax.random.key(0), (2, 16, 8))
    mask = jnp.arange(16)[None, :] < jnp.array([[16], [13]])
    cfg = (("num_landmarks", 3),)
    one = la.linen.MultiHeadAttention(num_heads=2, attention="nystromformer", attention_config=cfg)
    par = one.clone(mesh=mesh, seq_axis="seq", batch_axes=("data",))
    variables = jax.jit(lambda r: one.init({"params": r}, x, mask=mask))(jax.random.key(1))
    want = jax.jit(lambda v, x: one.apply(v, x, mask=mask))(variables, x)
    got = jax.jit(lambda v, x: par.apply(v, x, mask=mask))(variables, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-5)

    def build(mesh=None):
        cfg = {"num_features": 8}
        rngs = nnx.Rngs(params=0)
        return la.nn.MultiHeadAttention(
            2, 8, attention="performer", attention_config=cfg, rngs=rngs, mesh=mesh
        )

    one, par = build(), build(mesh)
    want = nnx.jit(lambda m, x: m(x, mask=mask, causal=True, deterministic=True))(one, x)
    got = nnx.jit(lambda m, x: m(x, mask=mask, causal=True, deterministic=True))(par, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-5)


def test_a_repeated_call_outside_jit_compiles_nothing_new(caplog):
    """The sequence-parallel function, called eagerly, compiles one program per call
    signature (an eager shard_map would compile each of its ops) and reuses it."""
    m = mech("performer")
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 8, 2, 4)) for i in range(3))
    params = init(m, h=2, d=4)
    fn = parallel.sequence_parallel(m, _mesh(), "seq")
    first = fn(q, k, v, params, causal=True)
    with caplog.at_level("WARNING"), jax.log_compiles():
        again = fn(q, k, v, params, causal=True)
    compiled = [r.getMessage() for r in caplog.records if "Finished XLA compilation" in r.message]
    assert compiled == []
    np.testing.assert_array_equal(np.asarray(again), np.asarray(first))
