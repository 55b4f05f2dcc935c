"""`train.bench.performer_jax`: loading the public Performer-JAX file from a user's path (with
stand-ins for gin while it loads) and the side-by-side harness. The public file is not in
the project; a file with its entry point's signature stands in for it here."""

import json
import sys

import pytest

from train.bench import performer_jax
from train.bench.__main__ import build_parser

FAKE_PUBLIC = """
import gin
from absl import logging
import jax
import jax.numpy as jnp

CALLS = []


@gin.configurable
def make_fast_softmax_attention(qkv_dim, nb_features=256, redraw_features=True,
                                unidirectional=False):
    CALLS.append((qkv_dim, nb_features, redraw_features, unidirectional))
    logging.info("made")

    def attend(q, k, v):  # [B, T, H, d]: exact softmax attention
        s = jnp.einsum("bihd,bjhd->bhij", q, k) / jnp.sqrt(qkv_dim)
        if unidirectional:
            t = q.shape[1]
            s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
        return jnp.einsum("bhij,bjhd->bihd", jax.nn.softmax(s, -1), v)

    return attend
"""


@pytest.fixture
def public_checkout(tmp_path):
    path = tmp_path / performer_jax.PUBLIC_PATH
    path.parent.mkdir(parents=True)
    path.write_text(FAKE_PUBLIC)
    return tmp_path


def test_load_public_from_a_checkout_or_the_file_leaves_sys_modules_as_it_was(public_checkout):
    before = {n: sys.modules.get(n) for n in ("gin", "absl", "absl.logging")}
    for where in (public_checkout, public_checkout / performer_jax.PUBLIC_PATH):
        module = performer_jax.load_public(str(where))
        assert callable(module.make_fast_softmax_attention)
        module.make_fast_softmax_attention(8)  # the stand-ins work when called, too
        assert module.CALLS == [(8, 256, True, False)]
        assert {n: sys.modules.get(n) for n in before} == before


def test_load_public_names_the_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="performer/fast_attention/jax/fast_attention.py"):
        performer_jax.load_public(str(tmp_path))


def test_command_times_every_cell_and_tabulates(public_checkout, tmp_path, capsys, monkeypatch):
    made = []
    load = performer_jax.load_public
    monkeypatch.setattr(
        performer_jax, "load_public", lambda repo: made.append(load(repo)) or made[-1]
    )
    out = tmp_path / "perf.json"
    args = build_parser().parse_args(
        ["performer_jax", "--repo", str(public_checkout), "--seq-lens", "8", "16",
         "--heads", "2", "--head-dim", "4", "--num-features", "8", "--repeats", "1",
         "--out", str(out), "--quiet"]
    )  # fmt: skip
    result = performer_jax.main_from_args(args)
    rows = result["rows"]
    assert len(rows) == 2 * 2 * 2 * 2  # lengths x causal x public redraw x modes
    assert {(r["seq_len"], r["causal"], r["public_redraw"], r["mode"]) for r in rows} == {
        (t, c, p, m)
        for t in (8, 16)
        for c in (False, True)
        for p in (False, True)
        for m in ("forward", "forward+backward")
    }
    for r in rows:
        assert r["ours_ms"] > 0 and r["public_ms"] > 0
        assert r["speedup"] == pytest.approx(r["public_ms"] / r["ours_ms"])
    # the public entry point got the head size, the features and each (redraw, causal)
    assert sorted(set(made[0].CALLS)) == [
        (4, 8, p, c) for p in (False, True) for c in (False, True)
    ]
    saved = json.loads(out.read_text())
    assert saved["rows"] == rows and saved["config"] == result["config"]
    table = capsys.readouterr().out
    assert "| ours / public (public projection fixed / redrawn) | T = 8 | T = 16 |" in table
    assert table.count("x / ") == 8  # four modes x two lengths
