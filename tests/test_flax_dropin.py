"""Flax's own attention modules with our mechanisms, and ours as drop-ins for flax's.

Every mechanism x {no mask, padding, causal, causal + padding, a causal mask not declared
causal, per-head mask, bias, dropout}, inside ``nn.MultiHeadDotProductAttention`` (linen,
``attention_fn=la.linen.attention_fn(...)``), ``nnx.MultiHeadAttention``
(``attention_fn=la.nn.attention_fn(...)``) and our ``la.linen`` / ``la.nn``
``MultiHeadAttention`` with the same weights: each call equals the reference or raises
ValueError. The reference is flax's native attention for softmax, else the same flax
module with an ``attention_fn`` that calls the mechanism's own `attention` with the
equivalent key-padding mask and causal flag (known from the case, not read off the mask).
"""

import dataclasses
import inspect
from functools import cache, partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import SMALL_CONFIG
from flax import nnx

import linattn_jax as la
from linattn_jax import registry
from linattn_jax.ra import ra_flax_attention

B, T, F, H = 2, 4, 8, 2
D = F // H
X = jax.random.normal(jax.random.key(0), (B, T, F))
PAD = jnp.array([[True] * T, [True] * (T - 1) + [False]])
CAUSAL = nn.make_causal_mask(X[..., 0])
PER_HEAD = jnp.ones((B, H, T, T), bool).at[:, 1, :, 1].set(False)

# case -> (flax mask, key padding, causal) for the cases a flax module can carry
CASES = {
    "none": (None, None, False),
    "padding": (nn.make_attention_mask(PAD, PAD), PAD, False),
    "causal": (CAUSAL, None, True),
    "causal_padding": (nn.combine_masks(nn.make_attention_mask(PAD, PAD), CAUSAL), PAD, True),
    "causal_undeclared": (CAUSAL, None, False),
    "per_head": (PER_HEAD, None, False),
    "dropout": (None, None, False),
}
# ra honours these exactly in expectation (its own draws): test_ra_flax_* below
RA_OWN_TESTS = {"per_head", "dropout", "bias"}
# what a refused case's error names
REFUSAL = {
    "causal_undeclared": "is causal",
    "per_head": "per-head or per-query",
    "dropout": "dropout_rate",
    "bias": "bias",
}


@pytest.fixture(scope="module", autouse=True)
def _compiled_mechanisms():
    """Eager calls re-trace and re-compile a mechanism's scans every time: one jitted
    `attention_fn` per mechanism (the same function) compiles each form once per file."""
    with pytest.MonkeyPatch.context() as mp:
        for name in la.names():
            mech = registry.get(name)
            fn = mech.attention_fn
            static = [
                p.name
                for p in inspect.signature(fn).parameters.values()
                if p.kind is p.KEYWORD_ONLY and p.name != "mask"
            ]
            jitted = jax.jit(fn, static_argnames=static)
            mp.setitem(registry._REGISTRY, name, dataclasses.replace(mech, attention_fn=jitted))
        yield


def _config(name):
    return {k: v for k, v in SMALL_CONFIG.get(name, {}).items() if k != "num_samples"}


def _refusal(name, case):
    """None when the call must succeed, else the text its ValueError must contain."""
    if name == "softmax":
        return None  # flax's own attention: any mask, bias and dropout
    if name == "ra" and case == "causal_undeclared":
        return None  # ra honours any mask: the causal mask is causal attention
    if case in REFUSAL:
        return REFUSAL[case]
    if CASES[case][2] and not la.get(name).supports_causal:
        return "cannot be causal"
    return None


def _reference_fn(mech, params, key_pad, causal):
    def fn(query, key, value, **unused):
        del unused
        return mech.attention(
            query, key, value, params, None, mask=key_pad, causal=causal, deterministic=True
        )

    return fn


def _check(got_fn, want_fn, refusal, where):
    if refusal is not None:
        with pytest.raises(ValueError, match=refusal):
            got_fn()
        return
    np.testing.assert_allclose(got_fn(), want_fn(), rtol=1e-6, atol=1e-6, err_msg=where)


@pytest.mark.parametrize("name", la.names())
def test_linen_mhdpa_and_dropin(name):
    mech = la.get(name).bind(**_config(name))
    rngs = {"params": jax.random.key(1), "dropout": jax.random.key(2)}
    base = nn.MultiHeadDotProductAttention(
        num_heads=H, deterministic=False, attention_fn=la.linen.attention_fn(name, **_config(name))
    )
    variables = base.init(jax.random.key(0), X)
    params = {
        **variables["params"].get("attention_fn", {}),
        **variables.get("fixed", {}).get("attention_fn", {}),
    }
    params = nn.meta.unbox(params)
    for case, (mask, key_pad, causal) in CASES.items():
        if name == "ra" and case in RA_OWN_TESTS:
            continue
        rate = 0.5 if case == "dropout" else 0.0
        declared = causal and case != "causal_undeclared"
        ref_causal = causal or case == "causal_undeclared"  # ra honours the causal mask
        fn = la.linen.attention_fn(name, causal=declared, **_config(name))
        mhdpa = base.clone(dropout_rate=rate, attention_fn=fn)
        if name == "softmax":
            ref = nn.MultiHeadDotProductAttention(
                num_heads=H, dropout_rate=rate, deterministic=False
            )
        else:
            ref = base.clone(attention_fn=_reference_fn(mech, params, key_pad, ref_causal))
        refusal = _refusal(name, case)
        want = cache(partial(ref.apply, variables, X, mask=mask, rngs=rngs))
        _check(
            partial(mhdpa.apply, variables, X, mask=mask, rngs=rngs),
            want,
            refusal,
            f"{name} {case} in nn.MultiHeadDotProductAttention",
        )
        # ours, with flax's projection weights (same paths) and the attention_fn's params
        ours = la.linen.MultiHeadAttention(
            num_heads=H,
            dropout_rate=rate,
            deterministic=False if rate else None,
            attention=name,
            attention_config=tuple(_config(name).items()),
        )
        mine = {"params": {k: v for k, v in variables["params"].items() if k != "attention_fn"}}
        fixed = {k: v for k, v in params.items() if k in mech.fixed_params()}
        if len(fixed) < len(params):
            mine["params"]["mechanism"] = {k: v for k, v in params.items() if k not in fixed}
        if fixed:
            mine["fixed"] = {"mechanism": fixed}
        _check(
            partial(ours.apply, mine, X, mask=mask, causal=declared, rngs=rngs),
            want,
            refusal,
            f"{name} {case} in la.linen.MultiHeadAttention",
        )


def _nnx(name, rate, fn=None, **kw):
    cls = nnx.MultiHeadAttention if "attention" not in kw else la.nn.MultiHeadAttention
    extra = {} if fn is None else {"attention_fn": fn}
    return cls(
        H, F, dropout_rate=rate, decode=False, rngs=nnx.Rngs(params=0, dropout=1), **extra, **kw
    )


@pytest.mark.parametrize("name", la.names())
def test_nnx_mha_and_dropin(name):
    mech = la.get(name).bind(**_config(name))
    for case, (mask, key_pad, causal) in CASES.items():
        if name == "ra" and case in RA_OWN_TESTS:
            continue
        rate = 0.5 if case == "dropout" else 0.0
        declared = causal and case != "causal_undeclared"
        ref_causal = causal or case == "causal_undeclared"  # ra honours the causal mask
        det = False if rate else None
        fn = la.nn.attention_fn(name, num_heads=H, head_dim=D, rngs=nnx.Rngs(3), **_config(name))
        params = fn.mechanism_params() if hasattr(fn, "mechanism_params") else {}
        if name == "softmax":
            ref = _nnx(name, rate)
        else:
            ref = _nnx(name, rate, _reference_fn(mech, params, key_pad, ref_causal))
        refusal = _refusal(name, case)
        want = cache(partial(ref, X, mask=mask, deterministic=det))
        mha = _nnx(name, rate, fn)
        _check(
            partial(mha, X, mask=mask, is_causal=declared, deterministic=det),
            want,
            refusal,
            f"{name} {case} in nnx.MultiHeadAttention",
        )
        ours = _nnx(name, rate, attention=name, attention_config=_config(name))
        nnx.update(ours, nnx.state(ref, nnx.Param))
        for k, v in params.items():
            ours.mechanism[k][...] = v
        _check(
            partial(ours, X, mask=mask, is_causal=declared, deterministic=det),
            want,
            refusal,
            f"{name} {case} in la.nn.MultiHeadAttention",
        )


@pytest.mark.parametrize("name", [n for n in la.names() if n != "ra"])
def test_attention_fn_bias(name):
    """Flax's modules pass no bias; a direct call in flax's convention does."""
    q, k, v = jax.random.normal(jax.random.key(4), (3, B, T, H, D))
    bias = jax.random.normal(jax.random.key(5), (B, H, T, T))
    fn = la.linen.attention_fn(name, **_config(name))
    if isinstance(fn, nn.Module):
        fn = fn.bind(fn.init(jax.random.key(0), q, k, v))
    _check(
        lambda: fn(q, k, v, bias=bias),
        lambda: nn.dot_product_attention(q, k, v, bias),
        _refusal(name, "bias"),
        f"{name} bias",
    )


def test_traced_mask_poisons_unrepresentable_rows():
    """Under jit the mask's values are unknown: a batch row whose mask a mechanism cannot
    represent comes out NaN, the others equal the reference."""
    q, k, v = jax.random.normal(jax.random.key(4), (3, B, T, H, D))
    fn = jax.jit(la.linen.attention_fn("linear_elu"))
    mask = jnp.stack([jnp.ones((H, T, T), bool), PER_HEAD[1]])  # row 1 per-head
    out = fn(q, k, v, mask=mask)
    assert bool(jnp.all(jnp.isnan(out[1])))
    want = la.get("linear_elu").attention(q, k, v, {})
    np.testing.assert_allclose(out[0], want[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        fn(q, k, v, mask=nn.make_attention_mask(PAD, PAD)),
        la.get("linear_elu").attention(q, k, v, {}, mask=PAD),
        rtol=1e-6,
        atol=1e-6,
    )


def _ra_case(seed):
    """Inputs, a random per-head, per-query mask with a valid key in every row, and a bias."""
    kq, kk, kv, km, kb = jax.random.split(jax.random.key(seed), 5)
    q, k, v = (jax.random.normal(x, (B, T, H, D)) for x in (kq, kk, kv))
    mask = jax.random.bernoulli(km, 0.6, (B, H, T, T)).at[..., 0].set(True)
    return q, k, v, mask, jax.random.normal(kb, (B, H, T, T))


def test_ra_flax_mask_rows_are_ras_key_padding_rows():
    """RA's draws are indexed by query position: each query row under a per-head,
    per-query flax mask equals that row of ra with the row's pattern as key padding, in
    both the sampled and the deterministic form."""
    q, k, v, mask, _ = _ra_case(0)
    ra = la.get("ra")
    rng = jax.random.key(7)
    fn = la.linen.attention_fn("ra")
    for r in (rng, None):
        got = ra_flax_attention(q, k, v, r, mask=mask)
        for h in range(H):
            for i in range(T):
                want = ra.attention(q, k, v, {}, r, mask=mask[:, h, i], deterministic=r is None)
                np.testing.assert_allclose(got[:, i, h], want[:, i, h], rtol=1e-5, atol=1e-6)
    # through flax's attention_fn signature (deterministic: no dropout_rng)
    np.testing.assert_allclose(fn(q, k, v, mask=mask), ra_flax_attention(q, k, v, mask=mask))


def test_ra_flax_is_unbiased_for_flax_softmax_with_mask_bias_and_dropout():
    """The mean of S one-draw RA outputs with flax's mask, bias and dropout (the same
    dropout_rng) is flax's ``dot_product_attention`` within 5 standard errors everywhere;
    the same draws without the bias are not (so the bound can fail)."""
    q, k, v, mask, bias = _ra_case(1)
    s = 4096
    drop = dict(dropout_rate=0.3, dropout_rng=jax.random.key(3), broadcast_dropout=False)
    want = nn.dot_product_attention(q, k, v, bias, mask, deterministic=False, **drop)

    def draws(b):
        one = lambda r: ra_flax_attention(q, k, v, r, mask=mask, bias=b, **drop)  # noqa: E731
        return jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(9), s))

    for b, unbiased in ((bias, True), (None, False)):
        outs = draws(b)
        se = jnp.std(outs, axis=0, ddof=1) / np.sqrt(s)
        z = jnp.abs(jnp.mean(outs, axis=0) - want) / (se + 1e-7)
        assert bool(jnp.all(z < 5)) == unbiased, float(jnp.max(z))


def test_ra_attention_fn_dropout_rng_semantics():
    """In flax's module, ra with dropout keeps flax's keep mask (drawn from dropout_rng)
    and samples with fold_in(dropout_rng, 1)."""
    q, k, v, mask, bias = _ra_case(2)
    key = jax.random.key(4)
    fn = la.linen.attention_fn("ra")
    got = fn(q, k, v, bias=bias, mask=mask, dropout_rng=key, dropout_rate=0.5, deterministic=False)
    want = ra_flax_attention(
        q,
        k,
        v,
        jax.random.fold_in(key, 1),
        mask=mask,
        bias=bias,
        dropout_rate=0.5,
        dropout_rng=key,
    )
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_ra_dropout_in_our_modules_equals_flax_class():
    """ra with dropout in la.linen / la.nn.MultiHeadAttention equals flax's own classes with
    ``attention_fn("ra")``: the same keep mask (flax's dropout stream) and the same draws."""
    causal = nn.make_causal_mask(X[..., 0])
    rngs = {"dropout": jax.random.key(2)}
    base = nn.MultiHeadDotProductAttention(
        num_heads=H, dropout_rate=0.5, deterministic=False, attention_fn=la.linen.attention_fn("ra")
    )
    variables = base.init(jax.random.key(0), X)
    want = base.apply(variables, X, mask=causal, rngs=rngs)
    ours = la.linen.MultiHeadAttention(
        num_heads=H, dropout_rate=0.5, deterministic=False, attention="ra"
    )
    np.testing.assert_allclose(
        ours.apply(variables, X, mask=causal, rngs=rngs), want, rtol=1e-6, atol=1e-6
    )
    ref = _nnx("ra", 0.5, la.nn.attention_fn("ra"))
    mine = _nnx("ra", 0.5, attention="ra")
    nnx.update(mine, nnx.state(ref, nnx.Param))
    np.testing.assert_allclose(
        mine(X, mask=causal, deterministic=False, rngs=nnx.Rngs(dropout=5)),
        ref(X, mask=causal, deterministic=False, rngs=nnx.Rngs(dropout=5)),
        rtol=1e-6,
        atol=1e-6,
    )
