"""The feature-map protocol (SPEC section 7): ``la.get(name).feature_map``."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import init, mech, qkv

import linattn_jax as la
from linattn_jax import core
from linattn_jax.core import causal as core_causal

#: The feature-map mechanisms; every other mechanism has ``feature_map is None``.
FEATURE_MAP_NAMES = ["linear_elu", "performer", "rfa", "hedgehog", "flexformer_s", "flexformer_n"]
_CASES = [(n, {}) for n in FEATURE_MAP_NAMES] + [
    ("rfa", {"gate": True}),
    ("flexformer_n", {"features": "trig"}),  # its default is the positive map
]


def test_which_mechanisms_are_feature_maps():
    got = [n for n in la.names() if la.get(n).feature_map is not None]
    assert sorted(got) == sorted(FEATURE_MAP_NAMES)


@pytest.mark.parametrize(("name", "config"), _CASES, ids=str)
@pytest.mark.parametrize("deterministic", [True, False])
def test_attention_is_the_core_of_its_feature_map(name, config, deterministic):
    """Exactly what the mechanism hands to the core: its output from the protocol's
    features (random features resolved from the same rng), to float32 rounding (1e-6: the
    same operations, which XLA may fuse differently; a different feature, scale or mask
    moves outputs by far more)."""
    m = mech(name, **config)
    params = init(m)
    q, k, v = qkv(seed=3)
    mask = jnp.arange(12)[None, :] < jnp.array([[12], [7]])
    rng = jax.random.key(5)
    causal = bool(config.get("gate"))
    want = m.attention(q, k, v, params, rng, mask=mask, causal=causal, deterministic=deterministic)
    fm = m.feature_map
    p = fm.resolve(params, rng, deterministic=deterministic)
    keys = fm.key(k, p)
    assert isinstance(keys, core.KeyFeatures) and keys.phi.shape[:3] == k.shape[:3]
    got = core.attend(
        fm.query(q, p),
        keys.phi,
        v,
        q.dtype,
        mask=mask,
        causal=causal,
        chunk_size=m.defaults.get("chunk_size", 64),
        log_decay=keys.log_decay,
        key_log_scale=keys.log_scale,
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    if m.stochastic and not deterministic:  # the redraw really redraws
        assert not np.array_equal(np.asarray(fm.key(k, params).phi), np.asarray(keys.phi))


def test_feature_map_carries_the_bound_config():
    fm = la.get("rfa").bind(gate=True).feature_map
    params = la.get("rfa").init(jax.random.key(0), num_heads=2, head_dim=8, gate=True)
    q, k, _ = qkv()
    assert fm.key(k, params).log_decay.shape == k.shape[:3]
    assert la.get("rfa").feature_map.key(k, params).log_decay is None


def test_recurrent_step_equals_the_causal_core():
    """Token by token, `core.recurrent_step` gives the chunked causal output (decays and key
    log-scales included)."""
    b, t, h, m_, dv = 2, 9, 2, 5, 3
    ks = jax.random.split(jax.random.key(0), 5)
    pq = jnp.exp(jax.random.normal(ks[0], (b, t, h, m_)))
    pk = jnp.exp(jax.random.normal(ks[1], (b, t, h, m_)))
    v = jax.random.normal(ks[2], (b, t, h, dv))
    n = 30.0 * jax.random.normal(ks[3], (b, t, h))
    g = jax.nn.log_sigmoid(jax.random.normal(ks[4], (b, t, h)))
    for log_scale, log_decay in ((n, None), (None, g)):
        want = core.linear_attention(
            pq, pk, v, causal=True, chunk_size=4, key_log_scale=log_scale, log_decay=log_decay
        )
        state = core.recurrent_init(b, h, m_, dv)
        outs = []
        for i in range(t):
            sl = slice(i, i + 1)
            keys = core.KeyFeatures(
                pk[:, sl],
                None if log_scale is None else log_scale[:, sl],
                None if log_decay is None else log_decay[:, sl],
            )
            out, state = core.recurrent_step(state, pq[:, sl], keys, v[:, sl])
            outs.append(out)
        np.testing.assert_allclose(jnp.concatenate(outs, 1), want, rtol=1e-4, atol=1e-5)


def test_recurrent_step_stable_for_huge_key_scales():
    """The running-max stabiliser: key log-scales far beyond float32's exp range (up to 400)
    give the exact ratio, checked against float64 prefix sums."""
    rng = np.random.default_rng(0)
    t, m, dv = 9, 5, 3
    a = rng.uniform(-400, 400, (1, t, 1))
    b = rng.uniform(0.1, 1.0, (1, t, 1, m))
    v = rng.standard_normal((1, t, 1, dv))
    pq = rng.uniform(0.1, 1.0, (1, t, 1, m))
    state = core.recurrent_init(1, 1, m, dv)
    for i in range(t):
        sl = slice(i, i + 1)
        keys = core.KeyFeatures(jnp.asarray(b[:, sl], jnp.float32), jnp.asarray(a[:, sl]))
        out, state = core.recurrent_step(state, jnp.asarray(pq[:, sl]), keys, jnp.asarray(v[:, sl]))
        w = np.exp(a[0, : i + 1, 0] - a[0, : i + 1, 0].max()) * (b[0, : i + 1, 0] @ pq[0, i, 0])
        want = w @ v[0, : i + 1, 0] / w.sum()
        np.testing.assert_allclose(np.asarray(out[0, 0, 0]), want, rtol=1e-4, atol=1e-6)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in state)


@pytest.mark.parametrize(("name", "config"), _CASES, ids=str)
def test_causal_features_in_the_scan_equal_the_whole_sequence_features(name, config):
    """A token-wise map's causal path computes its features chunk by chunk inside the scan;
    it equals the core on the whole sequence's features (forward and gradients, params
    included), with a ragged last chunk and masked keys; the flexformers carry their
    denominator floor's mass channel (a floor of 0.5, which acts at these shapes; the
    default 0.05 does not), gated rfa its log decay."""
    if la.get(name).feature_map.floor_fn is not None:
        config = {**config, "den_floor": 0.5}
    m = mech(name, **config)
    fm = m.feature_map
    assert fm.token_wise
    params = init(m)
    q, k, v = qkv(seed=4, tq=11, tk=11)
    mask = jnp.arange(11)[None, :] < jnp.array([[11], [6]])
    whole = dataclasses.replace(fm, token_wise=False)

    def run(f):
        def loss(q, k, v, p):
            out = core.attend_features(
                f, q, k, v, p, mask=mask, causal=True, deterministic=True, chunk_size=4
            )
            return jnp.sum(jnp.sin(out)), out

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, params)

    runs = [run(fm.bind(**config))]
    g_whole, out_whole = run(whole.bind(**config))
    if fm.bind(**config).den_floor() > 0:
        # the scan asks a floor read from the config for features without the mass channel;
        # a floor that ignores the config keeps the channel in the features' last column
        runs.append(run(dataclasses.replace(fm, floor_fn=lambda: 0.5).bind(**config)))
    for g_in, out_in in runs:
        np.testing.assert_allclose(out_in, out_whole, rtol=1e-5, atol=1e-6)
        for a, b in zip(jax.tree.leaves(g_in), jax.tree.leaves(g_whole), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("name", "config"), [("performer", {}), ("flexformer_n", {}), ("rfa", {"gate": True})], ids=str
)
def test_parallel_causal_form_of_a_token_wise_map_equals_the_scan(monkeypatch, name, config):
    """The accelerators' causal form (`core.causal.CAUSAL_FORM` "parallel": every chunk's
    features at once, the states by a parallel prefix) of a token-wise map equals the scan
    of the whole sequence's features, forward and gradients with params: performer's key
    log-scales, the flexformers' floor, gated rfa's decay; ragged chunks, masked keys."""
    m = mech(name, **config)
    params = init(m)
    q, k, v = qkv(seed=5, tq=11, tk=11)
    mask = jnp.arange(11)[None, :] < jnp.array([[11], [6]])
    fm = m.feature_map.bind(**config)

    def run(f, form):
        monkeypatch.setattr(core_causal, "CAUSAL_FORM", form)

        def loss(q, k, v, p):
            out = core.attend_features(
                f, q, k, v, p, mask=mask, causal=True, deterministic=True, chunk_size=4
            )
            return jnp.sum(jnp.sin(out)), out

        # jitted (one compile instead of op-by-op dispatch); `loss` is new per call, so
        # the two forms are traced apart
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, params)

    g_par, out_par = run(fm, "parallel")
    g_scan, out_scan = run(dataclasses.replace(fm, token_wise=False), "scan")
    np.testing.assert_allclose(out_par, out_scan, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g_par), jax.tree.leaves(g_scan), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", FEATURE_MAP_NAMES)
def test_noncausal_blocks_equal_the_whole_sequence_features(name):
    """Over more than two blocks a token-wise map whose features are wider than the head
    (M > d: all but linear_elu) computes its non-causal features block by block inside two
    scans (keys, then queries); that equals the core on the whole sequence's features
    (forward and gradients, params included), with ragged last blocks, Tq != Tk, masked keys
    (a block of only masked keys among them) and key log-scales that differ across blocks
    (inputs x 3). linear_elu (M = d) keeps the whole-sequence path."""
    m = mech(name)
    fm = m.feature_map
    params = init(m)
    q, k, v = qkv(seed=6, tq=11, tk=13)
    q, k = 3.0 * q, 3.0 * k
    mask = jnp.arange(13)[None, :] < jnp.array([[13], [3]])
    whole = dataclasses.replace(fm, token_wise=False)

    def run(f):
        def loss(q, k, v, p):
            out = core.attend_features(f, q, k, v, p, mask=mask, deterministic=True, block_size=4)
            return jnp.sum(jnp.sin(out)), out

        scans = str(jax.make_jaxpr(loss)(q, k, v, params)).count(" scan[")
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
        return scans, grad(q, k, v, params)

    (scans, (g_in, out_in)), (no_scans, (g_whole, out_whole)) = run(fm), run(whole)
    assert (scans, no_scans) == ((0, 0) if name == "linear_elu" else (2, 0))
    runs = [(g_in, out_in)]
    if fm.floor_fn is not None:
        # the blocks ask a floor read from the config for features without the mass channel;
        # a floor that ignores the config keeps the channel in the features' last column
        runs.append(run(dataclasses.replace(fm, floor_fn=lambda: fm.den_floor()))[1])
    for g_in, out_in in runs:
        np.testing.assert_allclose(out_in, out_whole, rtol=1e-5, atol=1e-6)
        for a, b in zip(jax.tree.leaves(g_in), jax.tree.leaves(g_whole), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_noncausal_blocks_refuse_a_decay():
    """Gated rfa's log decay needs causal attention, in blocks as on the whole sequence."""
    m = mech("rfa", gate=True)
    params = init(m)
    q, k, v = qkv(tq=9, tk=9)
    fm = m.feature_map
    for f in (fm, dataclasses.replace(fm, token_wise=False)):
        with pytest.raises(ValueError, match="log_decay needs causal=True"):
            core.attend_features(f, q, k, v, params, deterministic=True, block_size=4)


@pytest.mark.parametrize("causal", [True, False])
def test_forward_holds_one_chunk_of_features(causal):
    """The point of computing them in the scans: XLA's temp memory of the forward stays
    below the size of one sequence's query features (2 MB): it holds one chunk's (causal)
    or one 256-token block's (non-causal, more than two blocks of `block_size`)."""
    m = la.get("performer").bind(num_features=256)
    fm = m.feature_map
    params = m.init(jax.random.key(0), num_heads=2, head_dim=16)
    q, k, v = qkv(b=1, tq=1024, tk=1024, h=2, d=16, dv=16)

    def temp_bytes(f):
        def fn(q, k, v):
            return core.attend_features(
                f, q, k, v, params, causal=causal, deterministic=True, block_size=256
            )

        return jax.jit(fn).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    features = 1024 * 2 * 256 * 4  # one [B, T, H, M] float32 array
    fused, whole = temp_bytes(fm), temp_bytes(dataclasses.replace(fm, token_wise=False))
    print(f"forward temp bytes (causal={causal}): in the scans", fused, "whole sequence", whole)
    assert fused < features < whole
