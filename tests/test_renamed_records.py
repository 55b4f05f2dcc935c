"""A mechanism is its record: a renamed copy of any registered record (``dataclasses.replace(
la.get(name), name=...)``, registered) behaves exactly as the original in flax's
``MultiHeadDotProductAttention`` through ``la.linen.attention_fn``, in ``la.linen`` and
``la.nn`` ``MultiHeadAttention`` (masks, dropout, decoding), in sequence parallelism, in
an HF Flax BERT through ``la.hf.swap_attention`` and in ``python -m train`` (the preset's
mechanism settings, the kernel diagnostics, a training step): same outputs, or the same
error."""

import argparse
import dataclasses
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import SMALL_CONFIG
from flax import nnx
from jax.sharding import Mesh
from test_train import _run_steps, tiny_config, toy_task

import linattn_jax as la
from linattn_jax import registry
from train import cli
from train import kernel_diagnostics as kd

B, T, F, H = 2, 4, 8, 2
X = jax.random.normal(jax.random.key(0), (B, T, F))
CAUSAL = nn.make_causal_mask(X[..., 0])
PER_HEAD = jnp.ones((B, H, T, T), bool).at[:, 1, :, 1].set(False)
RNGS = {"params": jax.random.key(1), "dropout": jax.random.key(2), "attention": jax.random.key(3)}


@pytest.fixture
def copy_of():
    """Registers ``copy_<name>``, a renamed copy of the record, for one test."""

    def make(name):
        copy = f"copy_{name}"
        registry.register(dataclasses.replace(registry.get(name), name=copy))
        return copy

    return make  # conftest's registry_as_before removes the copies after the test


def _outcome(fn):
    """The call's output (as float64 numpy) or its error's type and message."""
    try:
        return np.asarray(fn(), np.float64)
    except (ValueError, NotImplementedError, TypeError) as e:
        return type(e), str(e)


def _same(a, b, name, copy, where):
    if isinstance(a, tuple):
        assert isinstance(b, tuple) and a[0] is b[0], (where, a, b)

        def named(message, who):  # the mechanism's name as a word, not inside one
            return re.sub(rf"\b{re.escape(who)}\b", "<m>", message)

        assert named(a[1], name) == named(b[1], copy), where
    else:
        assert not isinstance(b, tuple), (where, b)
        np.testing.assert_array_equal(a, b, err_msg=where)


@functools.cache
def _bert():
    """One tiny HF Flax BERT for every swap (`la.hf.swap_attention` returns a new model)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=20, hidden_size=F, num_hidden_layers=1, num_attention_heads=H,
        intermediate_size=16, max_position_embeddings=T + 2,
    )  # fmt: skip
    return transformers.FlaxBertModel(config, seed=0)


def _calls(name, cfg):
    """``where -> thunk`` for every place a record decides what happens."""
    calls = {}
    for case, mask, causal, rate in [
        ("causal", CAUSAL, True, 0.0),
        ("per_head", PER_HEAD, False, 0.0),
        ("dropout", None, False, 0.5),
    ]:
        mhdpa = nn.MultiHeadDotProductAttention(
            num_heads=H, deterministic=False, dropout_rate=rate,
            attention_fn=la.linen.attention_fn(name, causal=causal, **cfg),
        )  # fmt: skip
        ours = la.linen.MultiHeadAttention(
            num_heads=H, dropout_rate=rate, deterministic=False,
            attention=name, attention_config=tuple(cfg.items()),
        )  # fmt: skip
        for label, mod in (("flax", mhdpa), ("linen", ours)):
            kw = {"causal": causal} if label == "linen" else {}

            def call(mod=mod, mask=mask, kw=kw):
                variables = mod.init(RNGS, X, mask=mask, **kw)
                return mod.apply(variables, X, mask=mask, rngs=RNGS, **kw)

            calls[f"{label} {case}"] = call

        def nnx_call(mask=mask, causal=causal, rate=rate):
            layer = la.nn.MultiHeadAttention(
                H, F, attention=name, attention_config=cfg, dropout_rate=rate, decode=False,
                rngs=nnx.Rngs(params=0, dropout=1, attention=2),
            )  # fmt: skip
            return layer(X, mask=mask, causal=causal, deterministic=False)

        calls[f"nnx {case}"] = nnx_call

    def decode():
        layer = la.linen.MultiHeadAttention(
            num_heads=H, attention=name, attention_config=tuple(cfg.items()), decode=True,
            max_len=T,
        )  # fmt: skip
        init = jax.jit(functools.partial(layer.init, causal=True))
        apply = jax.jit(functools.partial(layer.apply, causal=True, mutable=["cache"]))
        return apply(init(RNGS, X[:, :1]), X[:, :1])[0]

    calls["decode"] = decode

    def seqpar():
        mesh = Mesh(np.array(jax.devices()[:2]), ("seq",))
        mech = la.get(name).bind(**cfg)
        attend = la.parallel.sequence_parallel(mech, mesh, "seq")
        q, k, v = jax.random.normal(jax.random.key(4), (3, B, T, H, F // H))
        params = mech.init(jax.random.key(5), num_heads=H, head_dim=F // H)
        return attend(q, k, v, params, deterministic=True)  # one compiled program (eager)

    calls["sequence_parallel"] = seqpar

    def hf():
        model = la.hf.swap_attention(_bert(), name, **cfg)
        ids = jnp.arange(B * T).reshape(B, T) % 20
        with jax.numpy_rank_promotion("allow"):  # HF's own heads broadcast by rank promotion
            return model(ids, attention_mask=jnp.ones((B, T)).at[1, -1].set(0)).last_hidden_state

    calls["hf"] = hf
    return calls


@pytest.mark.parametrize("name", la.names())
def test_renamed_copy_behaves_as_the_original(name, copy_of):
    copy = copy_of(name)
    cfg = SMALL_CONFIG.get(name, {})
    originals, copies = _calls(name, cfg), _calls(copy, cfg)
    for where in originals:
        _same(_outcome(originals[where]), _outcome(copies[where]), name, copy, where)


def test_origin_of_a_copy_is_its_original(copy_of):
    copy = copy_of("performer")
    assert la.origin(copy) == "performer" and la.origin("performer") == "performer"
    bound = dataclasses.replace(la.get("performer").bind(num_features=8), name="bound")
    registry.register(bound)  # other settings: a mechanism of its own
    assert la.origin("bound") == "bound"
    with pytest.raises(KeyError, match="unknown mechanism 'nope'"):
        la.origin("nope")


@pytest.mark.parametrize("task", ["listops", "vit"])
def test_renamed_copy_gets_the_originals_training_config(task, copy_of):
    """``python -m train --attention <copy>`` builds the original's config (the mini
    preset's feature and landmark counts, the ViT preset's LARA settings), but for the name;
    so does ``--compare <copy>``."""
    for name in la.names():
        copy = copy_of(name)
        args = {"task": task, "preset": "mini"}
        original = cli.build_config(argparse.Namespace(**args, attention=name))
        want = original.to_dict()
        got = cli.build_config(argparse.Namespace(**args, attention=copy)).to_dict()
        assert got.pop("attention") == copy and want.pop("attention") == name
        assert got == want, name
        compared = cli.set_attention(original, copy)  # --compare <copy> after <name>
        assert compared.attention_config.to_dict() == want["attention_config"], name


def test_renamed_copy_trains_and_diagnoses_as_the_original(copy_of):
    """flexformer_n (whose shift gap the diagnostics once decided by name): two training
    steps of the copy equal the original's, and so do its ``kernel/...`` entries."""
    task = toy_task()
    runs = {}
    for name in ("flexformer_n", copy_of("flexformer_n")):
        config = tiny_config(name, num_features=4)
        trainer, state, losses = _run_steps(config, task, jax.devices()[:1])
        runs[name] = (losses, jax.tree.leaves(state.params), kd.for_run(trainer, config).start)
    (losses, params, diag), (c_losses, c_params, c_diag) = runs.values()
    assert losses == c_losses and "kernel/shift_gap" in diag and diag == c_diag
    for a, b in zip(params, c_params, strict=True):
        np.testing.assert_array_equal(a, b)
