"""la.hf.swap_attention on tiny random HF Flax models (built from configs, nothing downloaded):
the pretrained weights kept, the padding mask, causality and head_mask honoured, what cannot
be represented refused, and train.distill finding and distilling the attention calls."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization

import linattn_jax as la
from train import distill

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _rank_promotion():
    """HF's own heads broadcast by rank promotion (conftest makes that an error)."""
    with jax.numpy_rank_promotion("allow"):
        yield


B, T, L, H = 2, 8, 2, 2
SELF = ("attention", "self")


def _config(cls, **kw):
    return cls(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=L,
        num_attention_heads=H,
        intermediate_size=32,
        max_position_embeddings=T + 4,
        **kw,
    )


@pytest.fixture(scope="module")
def bert():
    return transformers.FlaxBertModel(_config(transformers.BertConfig), seed=0)


@pytest.fixture(scope="module")
def inputs():
    ids = jax.random.randint(jax.random.key(1), (B, T), 3, 40)
    mask = jnp.array([[1] * T, [1] * 5 + [0] * (T - 5)], jnp.int32)
    return ids, mask


def _layer(params, i):
    return params["encoder"]["layer"][str(i)]["attention"]["self"]


def _close(a, b, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=0)


def test_softmax_swap_is_the_original_model(bert, inputs):
    ids, mask = inputs
    head_mask = jnp.ones((L, H)).at[0, 1].set(0.0)
    swapped = la.hf.swap_attention(bert, "softmax")
    for kw in ({}, {"attention_mask": mask}, {"attention_mask": mask, "head_mask": head_mask}):
        _close(swapped(ids, **kw).last_hidden_state, bert(ids, **kw).last_hidden_state)
    assert not np.allclose(bert(ids, head_mask=head_mask)[0], bert(ids)[0], atol=1e-3)


def test_mechanism_swap_keeps_the_weights_and_honours_padding(bert, inputs):
    ids, mask = inputs
    model = la.hf.swap_attention(bert, "flexformer_n", num_features=8)
    assert type(model) is type(bert) and type(model.module).__name__ == "FlaxBertModule"
    flat = jax.tree_util.tree_flatten_with_path(model.params)[0]
    new = {jax.tree_util.keystr(p) for p, _ in flat} - {
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(bert.params)[0]
    }
    mech = la.get("flexformer_n").bind(num_features=8)
    names = set(jax.eval_shape(lambda r: mech.init(r, num_heads=H, head_dim=8), jax.random.key(0)))
    assert new == {
        f"['encoder']['layer']['{i}']['attention']['self']['mechanism']['{n}']"
        for i in range(L)
        for n in names
    }
    for name in ("query", "key", "value"):
        _close(_layer(model.params, 1)[name]["kernel"], _layer(bert.params, 1)[name]["kernel"], 0)
    out = model(ids, attention_mask=mask).last_hidden_state
    # the padded keys take no part: their content changes nothing at the valid positions
    other = model(ids.at[1, 5:].set(7), attention_mask=mask).last_hidden_state
    _close(out[1, :5], other[1, :5], 1e-6)
    assert not np.allclose(model(ids.at[1, 5:].set(7))[0][1, :5], out[1, :5], atol=1e-5)
    assert not np.allclose(out, bert(ids, attention_mask=mask)[0], atol=1e-4)  # not softmax


def test_a_saved_swap_reloads(bert, inputs, tmp_path):
    ids, mask = inputs
    model = la.hf.swap_attention(bert, "flexformer_n", num_features=8)
    model.params = jax.tree.map(lambda x: x * 1.5, model.params)  # "trained"
    model.save_pretrained(tmp_path)
    loaded = type(bert).from_pretrained(tmp_path)
    again = la.hf.swap_attention(loaded, "flexformer_n", num_features=8)
    saved = serialization.msgpack_restore(Path(tmp_path, "flax_model.msgpack").read_bytes())
    again.params, kept = la.transplant(saved, again.params, return_kept=True)
    assert kept == []
    _close(again(ids, attention_mask=mask)[0], model(ids, attention_mask=mask)[0], 0)


def test_causal_decoder_and_heads(inputs):
    ids, mask = inputs
    cfg = _config(transformers.RobertaConfig, is_decoder=True, pad_token_id=0)
    lm = transformers.FlaxRobertaForCausalLM(cfg, seed=0)
    _close(la.hf.swap_attention(lm, "softmax")(ids, attention_mask=mask).logits,
           lm(ids, attention_mask=mask).logits, 1e-5)  # fmt: skip
    model = la.hf.swap_attention(lm, "hedgehog")
    logits = model(ids).logits
    _close(model(ids.at[:, 5:].set(3)).logits[:, :5], logits[:, :5], 1e-5)  # no look-ahead
    with pytest.raises(ValueError, match="cannot be causal"):
        la.hf.swap_attention(lm, "nystromformer")


def test_fixed_features_are_drawn_not_stored(bert, inputs):
    ids, mask = inputs
    model = la.hf.swap_attention(bert, "performer", num_features=8)
    assert set(_layer(model.params, 0)) == {"query", "key", "value"}  # no empty `mechanism`
    a = model(ids, attention_mask=mask).last_hidden_state
    _close(model(ids, attention_mask=mask).last_hidden_state, a, 0)
    again = la.hf.swap_attention(bert, "performer", num_features=8, seed=1)
    assert not np.allclose(again(ids, attention_mask=mask)[0], a, atol=1e-5)


def test_refusals(bert, inputs):
    ids, mask = inputs
    model = la.hf.swap_attention(bert, "linear_elu")
    with pytest.raises(ValueError, match="output_attentions"):
        model(ids, output_attentions=True)
    with pytest.raises(ValueError, match="attention_probs_dropout_prob=0.1"):
        model(ids, train=True, dropout_rng=jax.random.key(0))
    with pytest.raises(ValueError, match="already runs 'linear_elu'"):
        la.hf.swap_attention(model, "softmax")
    with pytest.raises(TypeError, match="FlaxPreTrainedModel"):
        la.hf.swap_attention(bert.module, "softmax")
    with pytest.raises(TypeError, match="no_such_key"):
        la.hf.swap_attention(bert, "performer", no_such_key=1)
    cfg = transformers.DistilBertConfig(vocab_size=40, dim=16, n_layers=1, n_heads=2, hidden_dim=32)
    with pytest.raises(ValueError, match="'distilbert'.*supported"):
        la.hf.swap_attention(transformers.FlaxDistilBertModel(cfg, _do_init=False), "softmax")
    # training without attention dropout works (and samples nothing for linear_elu)
    bert.config.attention_probs_dropout_prob = 0.0
    try:
        model(ids, train=True, dropout_rng=jax.random.key(0))
    finally:
        bert.config.attention_probs_dropout_prob = 0.1


def test_import_does_not_need_transformers():
    code = "import sys, linattn_jax; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_distill_captures_and_distils_an_hf_model(bert, inputs):
    ids, mask = inputs
    student = la.hf.swap_attention(bert, "flexformer_n", num_features=8)
    teacher_vars, student_vars = {"params": bert.params}, {"params": student.params}
    calls = distill.capture_attention(bert.module, teacher_vars, ids, mask, deterministic=True)
    paths = [("encoder", "layer", str(i), *SELF) for i in range(L)]
    assert [c.path for c in calls] == paths == distill.attention_paths(student_vars)
    assert all(c.q.shape == (B, T, H, 8) and not c.causal for c in calls)
    np.testing.assert_array_equal(calls[0].mask, mask > 0)
    # the student's first queries are the teacher's: the swap kept the projections
    s_calls = distill.capture_attention(student.module, student_vars, ids, mask, deterministic=True)
    _close(s_calls[0].q, calls[0].q, 0)
    assert not np.allclose(s_calls[1].q, calls[1].q, atol=1e-5)  # after a swapped layer
    result = distill.distill_attention(
        bert.module,
        teacher_vars,
        "flexformer_n",
        student_vars,
        iter([(ids, mask)] * 3),
        num_steps=3,
        learning_rate=3e-2,
    )
    assert result.final_loss < result.initial_loss
    distilled = distill.with_mechanism_params(student_vars, result.params)
    student.params = distilled["params"]
    assert np.all(np.isfinite(student(ids, attention_mask=mask).last_hidden_state))
