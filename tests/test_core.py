"""The shared linear-attention core: chunked causal == masked quadratic reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linattn_jax import core
from linattn_jax.core import causal as core_causal


def _features(seed, b=2, t=13, h=2, m=6, dv=5, signed=False):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    pq = jax.random.normal(k1, (b, t, h, m))
    pk = jax.random.normal(k2, (b, t, h, m))
    if signed:  # some negative entries, denominators kept away from 0 (well-conditioned)
        pq, pk = 1.0 + 0.5 * pq, 1.0 + 0.5 * pk
    else:
        pq, pk = jnp.exp(pq), jnp.exp(pk)
    return pq, pk, jax.random.normal(k3, (b, t, h, dv))


def _assert_fast_matches_reference(run, pq, pk, v):
    """``run(fn, pq, pk, v)`` with the chunked `linear_attention` equals it with
    `quadratic_reference`: outputs and the gradients of ``sum(sin(out))`` wrt pq, pk, v."""
    # jitted: one compile per side instead of op-by-op dispatch (measured 2x faster here)
    fast = jax.jit(functools.partial(run, core.linear_attention))(pq, pk, v)
    ref = jax.jit(functools.partial(run, core.quadratic_reference))(pq, pk, v)
    np.testing.assert_allclose(fast, ref, rtol=1e-4, atol=1e-5)

    def grads(fn):
        loss = lambda *a: jnp.sum(jnp.sin(run(fn, *a)))  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(pq, pk, v)

    g_fast, g_ref = grads(core.linear_attention), grads(core.quadratic_reference)
    for a, b in zip(g_fast, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("t,chunk", [(13, 4), (16, 4), (13, 64), (1, 8), (7, 1), (20, 7)])
@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_causal_chunked_matches_quadratic(t, chunk, signed, with_mask):
    pq, pk, v = _features(t, t=t, signed=signed)
    mask = None
    if with_mask:
        mask = jax.random.bernoulli(jax.random.key(3), 0.7, (2, t)).at[:, 0].set(True)

    def f(fn, pq, pk, v):
        kw = dict(mask=mask, causal=True)
        if fn is core.linear_attention:
            kw["chunk_size"] = chunk
        return fn(pq, pk, v, **kw)

    _assert_fast_matches_reference(f, pq, pk, v)


@pytest.mark.parametrize("t,chunk", [(13, 4), (9, 9), (1, 3)])
def test_gated_causal_matches_quadratic(t, chunk):
    pq, pk, v = _features(1, t=t, signed=True)
    log_decay = jax.nn.log_sigmoid(jax.random.normal(jax.random.key(9), (2, t, 2)) + 1.0)

    def value_and_grads(fn):  # one compiled program per form (not one per eager op)
        out = lambda pq, pk, v, ld: fn(pq, pk, v, causal=True, log_decay=ld)  # noqa: E731
        grads = jax.grad(lambda *a: out(*a).sum(), (0, 3))
        return jax.jit(lambda *a: (out(*a), grads(*a)))(pq, pk, v, log_decay)

    fast, gf = value_and_grads(functools.partial(core.linear_attention, chunk_size=chunk))
    ref, gr = value_and_grads(core.quadratic_reference)
    np.testing.assert_allclose(fast, ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(gf, gr):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_gated_recurrence_matches_explicit_loop():
    """The decay form equals the literal recurrence S_t = g_t S_{t-1} + phi(k_t) v_t^T."""
    pq, pk, v = _features(2, b=1, t=6, h=1, m=3, dv=2)
    g = jax.nn.sigmoid(jax.random.normal(jax.random.key(4), (1, 6, 1)))
    s, z, outs = np.zeros((3, 2)), np.zeros(3), []
    for t in range(6):
        s = g[0, t, 0] * s + np.outer(pk[0, t, 0], v[0, t, 0])
        z = g[0, t, 0] * z + pk[0, t, 0]
        outs.append(pq[0, t, 0] @ s / (pq[0, t, 0] @ z))
    fast = core.linear_attention(pq, pk, v, causal=True, chunk_size=4, log_decay=jnp.log(g))
    np.testing.assert_allclose(fast[0, :, 0], np.stack(outs), rtol=1e-5, atol=1e-6)


def test_noncausal_matches_quadratic_and_masks():
    pq, pk, v = _features(5, t=11)
    mask = jnp.arange(11)[None, :] < jnp.array([[11], [4]])
    out = core.linear_attention(pq, pk, v, mask=mask)
    np.testing.assert_allclose(out, core.quadratic_reference(pq, pk, v, mask=mask), rtol=1e-5)
    # Row 1 equals the run on its 4 unpadded keys.
    short = core.linear_attention(pq[1:], pk[1:, :4], v[1:, :4])
    np.testing.assert_allclose(out[1:], short, rtol=1e-5, atol=1e-6)


def test_fully_masked_rows_are_zero_not_nan():
    pq, pk, v = _features(6, t=5, signed=True)
    mask = jnp.zeros((2, 5), bool)
    for causal in (False, True):
        out = core.linear_attention(pq, pk, v, mask=mask, causal=causal, chunk_size=2)
        assert jnp.all(out == 0.0)
        g = jax.grad(
            lambda x, c=causal: core.linear_attention(x, pk, v, mask=mask, causal=c).sum()
        )(pq)
        assert jnp.all(jnp.isfinite(g))


def test_guard_denominator():
    den = jnp.array([0.0, 1e-9, -1e-9, 0.5, -0.5])
    out = core.guard_denominator(den, eps=1e-6)
    np.testing.assert_allclose(out, [2e-6, 1e-9 + 2e-6, -1e-9 - 2e-6, 0.5, -0.5], rtol=1e-6)
    assert jnp.all(jnp.abs(out) > 1e-6)


def test_bf16_features_accumulate_in_f32():
    pq, pk, v = _features(7, t=33)
    out16 = core.linear_attention(
        pq.astype(jnp.bfloat16), pk.astype(jnp.bfloat16), v.astype(jnp.bfloat16), causal=True
    )
    assert out16.dtype == jnp.float32
    ref = core.quadratic_reference(
        *(x.astype(jnp.bfloat16).astype(jnp.float32) for x in (pq, pk, v)), causal=True
    )
    np.testing.assert_allclose(out16, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_key_log_scale_equals_explicit_scaling(causal):
    pq, pk, v = _features(8, t=13, signed=True)
    ns = 3.0 * jax.random.normal(jax.random.key(2), (2, 13, 2))
    mask = jax.random.bernoulli(jax.random.key(5), 0.7, (2, 13))
    explicit = core.quadratic_reference(
        pq, pk * jnp.exp(ns)[..., None], v, mask=mask, causal=causal
    )
    for fn in (core.linear_attention, core.quadratic_reference):
        kw = {"chunk_size": 4} if fn is core.linear_attention else {}
        out = fn(pq, pk, v, mask=mask, causal=causal, key_log_scale=ns, **kw)
        np.testing.assert_allclose(out, explicit, rtol=1e-4, atol=1e-5)
    g = jax.grad(
        lambda n: core.linear_attention(
            pq, pk, v, causal=causal, key_log_scale=n, chunk_size=4
        ).sum()
    )(ns)
    g_ref = jax.grad(
        lambda n: core.quadratic_reference(pq, pk * jnp.exp(n)[..., None], v, causal=causal).sum()
    )(ns)
    np.testing.assert_allclose(g, g_ref, rtol=1e-3, atol=1e-4)


def test_key_log_scale_is_stable_and_causal():
    """Huge log-scales stay finite, and a huge future key cannot reach past queries
    through the stabiliser (the running max only sees keys j <= i)."""
    pq, pk, v = _features(9, t=12, signed=True)
    ns = jnp.zeros((2, 12, 2))
    out = core.linear_attention(pq, pk, v, causal=True, key_log_scale=ns, chunk_size=4)
    ns_future = ns.at[:, 8:].set(500.0)  # exp(500) overflows float32 if not stabilised
    out2 = core.linear_attention(pq, pk, v, causal=True, key_log_scale=ns_future, chunk_size=4)
    assert jnp.all(jnp.isfinite(out2))
    np.testing.assert_allclose(out2[:, :8], out[:, :8], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------ relative denominator floor
def _signed_mass_features(seed, t=13, m=6, b=2):
    """Signed features N(0.5, 1) (denominators cancel: a third to half of the rows have
    ``|den| < 0.2 x`` their mass) with the mass channel."""
    pq, pk, v = _features(seed, b=b, t=t, m=m)
    pq, pk = jnp.log(pq) + 0.5, jnp.log(pk) + 0.5  # back to N(0, 1), shifted
    return core.mass_channel(pq, is_query=True), core.mass_channel(pk, is_query=False), v


def _den_and_mass(pq, pk, mask, causal):
    """Reference ``den`` and ``|phi(q_i)| sum_j |phi(k_j)|`` ``[B, H, Tq]`` (no key scale)."""
    vis = jnp.ones((pq.shape[1], pk.shape[1]), bool)
    if causal:
        vis = jnp.tril(vis)
    vis = vis[None, None] & (True if mask is None else mask[:, None, None, :])
    a = jnp.where(vis, jnp.einsum("bihm,bjhm->bhij", pq, pk), 0.0)
    nk = jnp.linalg.norm(pk[..., :-1], axis=-1).transpose(0, 2, 1)[:, :, None, :]
    nq = jnp.linalg.norm(pq, axis=-1).transpose(0, 2, 1)
    return a.sum(-1), nq * jnp.where(vis, nk, 0.0).sum(-1)


@pytest.mark.parametrize(
    ("causal", "extra"), [(False, "mask+scale"), (True, "mask+scale"), (True, "decay")]
)
@pytest.mark.parametrize("b", [2, 1])  # batch 1: `core.rowdot`'s contractions on the CPU
def test_den_floor_fast_paths_match_reference(causal, extra, b):
    """With the floor active on some rows, the chunked causal / non-causal forms equal the
    quadratic reference with the same floor, forward and gradients (mask, key log-scales
    or a decay), and the floor really is active on some rows and not on others."""
    gamma = 0.2
    pq, pk, v = _signed_mass_features(11, b=b)
    kw = dict(causal=causal, den_floor=gamma)
    mask = None
    if extra == "mask+scale":
        mask = jax.random.bernoulli(jax.random.key(4), 0.7, (b, 13)).at[:, 0].set(True)
        kw.update(mask=mask, key_log_scale=0.5 * jax.random.normal(jax.random.key(5), (b, 13, 2)))
    else:
        kw["log_decay"] = -jax.random.uniform(jax.random.key(6), (b, 13, 2))
    den, mass = _den_and_mass(pq, pk, mask, causal)
    active = np.asarray(jnp.abs(den) < gamma * mass)
    assert 0.1 < active.mean() < 0.9, active.mean()

    def run(fn, *a):
        extra_kw = {"chunk_size": 4} if fn is core.linear_attention else {}
        return fn(*a, **kw, **extra_kw)

    _assert_fast_matches_reference(run, pq, pk, v)


@pytest.mark.parametrize("shape", [(1, 3, 2, 5), (2, 3, 2, 5), (2, 1, 2, 5)])
def test_row_helpers_equal_the_plain_forms_with_gradients(shape):
    """`core.rowdot`, `core.scale_rows` and `core.divide_rows` (contractions where an axis
    of 1 makes XLA's CPU multiply-reduce slow, plain forms otherwise) equal ``sum(a * b,
    -1)``, ``x * r[..., None]`` and ``x / r[..., None]``, values and gradients."""
    ka, kb, kr = jax.random.split(jax.random.key(0), 3)
    a, b = jax.random.normal(ka, shape), jax.random.normal(kb, shape)
    r = jnp.exp(jax.random.normal(kr, shape[:-1]))
    pairs = [
        (lambda a, b, r: core.rowdot(a, b) * r, lambda a, b, r: jnp.sum(a * b, axis=-1) * r),
        (lambda a, b, r: core.scale_rows(a, r) * b, lambda a, b, r: a * r[..., None] * b),
        (lambda a, b, r: core.divide_rows(a, r) * b, lambda a, b, r: a / r[..., None] * b),
    ]
    for ours, plain in pairs:
        np.testing.assert_allclose(ours(a, b, r), plain(a, b, r), rtol=1e-6, atol=1e-6)
        loss = lambda f: lambda *args: jnp.sum(jnp.sin(f(*args)))  # noqa: E731
        g_ours = jax.grad(loss(ours), argnums=(0, 1, 2))(a, b, r)
        g_plain = jax.grad(loss(plain), argnums=(0, 1, 2))(a, b, r)
        for x, y in zip(g_ours, g_plain):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_den_floor_bounds_the_weights_and_matches_the_attention(causal):
    """The floored weights (`normalized_weights`) have row l1 norms <= 1 / gamma (the bound
    the floor exists for; without it they exceed it here), and the attention is exactly
    those weights times v."""
    gamma = 0.2
    pq, pk, v = _signed_mass_features(12, t=16)
    w = core.normalized_weights(pq, pk, causal=causal, den_floor=gamma)
    l1 = jnp.sum(jnp.abs(w), axis=-1)
    assert float(jnp.max(l1)) <= (1 + 1e-5) / gamma
    raw = core.normalized_weights(pq, pk, causal=causal)
    assert float(jnp.max(jnp.sum(jnp.abs(raw), axis=-1))) > 2 / gamma
    out = core.linear_attention(pq, pk, v, causal=causal, chunk_size=4, den_floor=gamma)
    np.testing.assert_allclose(out, jnp.einsum("bhij,bjhd->bihd", w, v), rtol=1e-4, atol=1e-5)


def test_den_floor_inactive_rows_are_unchanged_bitwise():
    """Rows whose |den| is above the floor come out bit for bit as the unfloored call on the
    features without the mass channel."""
    pq, pk, v = _features(13, t=13)  # positive features: |den| / mass well above 0.05
    aq, ak = core.mass_channel(pq, is_query=True), core.mass_channel(pk, is_query=False)
    for causal in (False, True):
        a = core.linear_attention(pq, pk, v, causal=causal, chunk_size=4)
        b = core.linear_attention(aq, ak, v, causal=causal, chunk_size=4, den_floor=0.05)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_den_floor_recurrent_step_matches_causal():
    gamma = 0.2
    pq, pk, v = _signed_mass_features(14, t=9)
    want = core.linear_attention(pq, pk, v, causal=True, chunk_size=4, den_floor=gamma)
    state = core.recurrent_init(2, 2, pq.shape[-1], v.shape[-1])
    outs = []
    for i in range(9):
        keys = core.KeyFeatures(pk[:, i : i + 1])
        out, state = core.recurrent_step(
            state, pq[:, i : i + 1], keys, v[:, i : i + 1], den_floor=gamma
        )
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), want, rtol=1e-4, atol=1e-5)


def test_den_floor_errors():
    pq, pk, v = _features(15, t=5, m=1)
    with pytest.raises(ValueError, match="mass channel"):
        core.linear_attention(pq, pk, v, den_floor=0.1)
    pq, pk, v = _signed_mass_features(15, t=5)
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match=r"den_floor must be in \[0, 1\)"):
            core.linear_attention(pq, pk, v, den_floor=bad)


def test_den_floor_zero_feature_rows_have_finite_gradients():
    """An all-zero query or key feature row (its norm's square root at 0) gives finite
    gradients through the floor."""
    pq, pk, v = _features(16, t=6)
    pq, pk = pq.at[:, 2].set(0.0), pk.at[:, 3].set(0.0)

    def loss(pq, pk):
        aq, ak = core.mass_channel(pq, is_query=True), core.mass_channel(pk, is_query=False)
        return jnp.sum(core.linear_attention(aq, ak, v, causal=True, den_floor=0.5))

    for g in jax.grad(loss, argnums=(0, 1))(pq, pk):
        assert bool(jnp.all(jnp.isfinite(g)))


def test_sincos_matches_float64_and_its_derivatives_are_cos_and_minus_sin():
    # every quadrant, small and large arguments up to the exact reduction's range (|x| < 1e4),
    # then beyond it
    x = np.concatenate([np.linspace(-7.0, 7.0, 20_001), np.linspace(-1e4, 1e4, 20_001)]).astype(
        np.float32
    )
    far = np.linspace(-1e5, 1e5, 20_001).astype(np.float32)
    for args, atol in ((x, 2e-7), (far, 2e-6)):
        sin, cos = jax.jit(core.sincos)(args)
        xd = args.astype(np.float64)  # the float32 input taken as exact
        # float32 rounds sin, cos near 1 by up to 6e-8; XLA's own sin/cos are within 4e-8
        np.testing.assert_allclose(np.asarray(sin), np.sin(xd), rtol=0, atol=atol)
        np.testing.assert_allclose(np.asarray(cos), np.cos(xd), rtol=0, atol=atol)
    xd = x.astype(np.float64)
    # first and second derivatives, through the custom JVP, under vmap
    d_sin = jax.vmap(jax.grad(lambda t: core.sincos(t)[0]))(x[:20_001])
    dd_cos = jax.vmap(jax.grad(jax.grad(lambda t: core.sincos(t)[1])))(x[:20_001])
    np.testing.assert_allclose(np.asarray(d_sin), np.cos(xd[:20_001]), rtol=0, atol=2e-7)
    np.testing.assert_allclose(np.asarray(dd_cos), -np.cos(xd[:20_001]), rtol=0, atol=2e-7)


@pytest.mark.parametrize("terms", [1, 2])
def test_cos_sin_is_the_stacked_sum_of_sincos_with_its_gradient(terms):
    # values: sincos's bit for bit; gradient (the custom VJP, recomputing from x) against
    # XLA's cos and sin, in float32 and for a bfloat16 input (cotangent in the input's dtype)
    m = 5
    x = 3.0 * jax.random.normal(jax.random.key(0), (2, 3, terms * m))
    g = jax.random.normal(jax.random.key(1), (2, 3, 2, m))
    sin, cos = core.sincos(x)
    parts = [slice(p * m, (p + 1) * m) for p in range(terms)]
    expected = jnp.stack([sum(cos[..., p] for p in parts), sum(sin[..., p] for p in parts)], -2)
    np.testing.assert_array_equal(np.asarray(core.cos_sin(x, terms)), np.asarray(expected))

    def naive(x):
        x = x.astype(jnp.float32)
        c = sum(jnp.cos(x[..., p]) for p in parts)
        return jnp.stack([c, sum(jnp.sin(x[..., p]) for p in parts)], -2)

    for xi, atol in ((x, 1e-6), (x.astype(jnp.bfloat16), 1e-2)):
        got = jax.grad(lambda t: jnp.sum(core.cos_sin(t, terms) * g))(xi)
        want = jax.grad(lambda t: jnp.sum(naive(t) * g))(xi)
        assert got.dtype == xi.dtype
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, rtol=0, atol=atol)


# ------------------------------------------------------------ the parallel causal form
@pytest.mark.parametrize("case", ["mask+scale", "decay", "floor"])
def test_parallel_causal_form_matches_quadratic(monkeypatch, case):
    """``CAUSAL_FORM="parallel"`` (the default on accelerators: every chunk at once, the
    states before each by a parallel prefix) equals the quadratic reference, forward and
    gradients: a ragged last chunk with masked keys and key log-scales (a running max that
    moves across chunks), a decay, the floor's mass channel."""
    monkeypatch.setattr(core_causal, "CAUSAL_FORM", "parallel")
    assert core_causal.causal_form() == "parallel"
    kw = dict(causal=True)
    if case == "floor":
        pq, pk, v = _signed_mass_features(11)
        kw.update(den_floor=0.2, mask=jnp.arange(13)[None, :] < jnp.array([[13], [8]]))
    else:
        pq, pk, v = _features(5, t=13, signed=True)
    if case == "mask+scale":
        kw["mask"] = jax.random.bernoulli(jax.random.key(3), 0.7, (2, 13)).at[:, 0].set(True)
        kw["key_log_scale"] = 3.0 * jax.random.normal(jax.random.key(4), (2, 13, 2))
    elif case == "decay":
        kw["log_decay"] = jax.nn.log_sigmoid(jax.random.normal(jax.random.key(9), (2, 13, 2)) + 1)

    def run(fn, *a):
        return fn(*a, **kw, **({"chunk_size": 4} if fn is core.linear_attention else {}))

    _assert_fast_matches_reference(run, pq, pk, v)


def test_parallel_causal_form_continues_a_state_as_the_scan_does(monkeypatch):
    """`causal_linear_attention_from` (the sequence-parallel path's entry) under both forms:
    the same output and final state from a non-empty initial state, with key log-scales and
    the floor; and the parallel form's program has no sequential loop, forward or backward."""
    pq, pk, v = _signed_mass_features(7, t=10)
    ns = 2.0 * jax.random.normal(jax.random.key(8), (2, 10, 2))
    first = core.block_state(pk[:, :3], v[:, :3], key_log_scale=ns[:, :3])

    args = (pq[:, 3:], pk[:, 3:], v[:, 3:])
    results = {}
    for form in ("scan", "parallel"):
        monkeypatch.setattr(core_causal, "CAUSAL_FORM", form)

        def run(pq, pk, v):  # a new function per form: jit would reuse the other's trace
            return core.causal_linear_attention_from(
                first, pq, pk, v, chunk_size=3, key_log_scale=ns[:, 3:], den_floor=0.2
            )

        loss = lambda *a: jnp.sum(jnp.sin(run(*a)[0]))  # noqa: E731
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        results[form] = (jax.jit(run)(*args), grad(*args))
        text = jax.jit(run).lower(*args).as_text() + grad.lower(*args).as_text()
        assert ("while" in text) == (form == "scan"), form
    (out_s, st_s), g_s = results["scan"]
    (out_p, st_p), g_p = results["parallel"]
    np.testing.assert_allclose(out_p, out_s, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves((st_p, g_p)), jax.tree.leaves((st_s, g_s)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_causal_form_resolves_and_checks(monkeypatch):
    monkeypatch.setattr(core_causal, "CAUSAL_FORM", "auto")
    assert core_causal.causal_form() == ("scan" if jax.default_backend() == "cpu" else "parallel")
    monkeypatch.setattr(core_causal, "CAUSAL_FORM", "fast")
    with pytest.raises(ValueError, match="must be one of"):
        core.linear_attention(*_features(0, t=4), causal=True)
