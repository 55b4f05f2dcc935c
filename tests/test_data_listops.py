"""ListOps: generator rules, exact evaluator, tokenizer, TSV round trip, task."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from train.data import DatasetNotFoundError, get_task, listops

OPS = {"[MIN", "[MAX", "[MED", "[SM"}


# ---------------------------------------------------------------- independent oracle
def _tree(tokens: list[str]):
    """Parse paren-free tokens into (op, [children]) / int, written apart from the module."""
    pos = 0

    def node():
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok in OPS:
            kids = []
            while tokens[pos] != "]":
                kids.append(node())
            pos += 1
            return (tok, kids)
        assert tok.isdigit() and len(tok) == 1, tok
        return int(tok)

    root = node()
    assert pos == len(tokens), "trailing tokens"
    return root


def _depth(t) -> int:
    """LRA depth: the root is depth 1 and leaves count."""
    return 1 if isinstance(t, int) else 1 + max(_depth(k) for k in t[1])


def _arities(t) -> list[int]:
    return [] if isinstance(t, int) else [len(t[1])] + [a for k in t[1] for a in _arities(k)]


def _lra_value(t) -> int:
    """LRA's to_value semantics: numpy median then int(); numpy sum mod 10."""
    if isinstance(t, int):
        return t
    op, kids = t
    vals = [_lra_value(k) for k in kids]
    return {
        "[MIN": lambda v: min(v),
        "[MAX": lambda v: max(v),
        "[MED": lambda v: int(np.median(v)),
        "[SM": lambda v: int(np.sum(v) % 10),
    }[op](vals)


def _strip(lra: str) -> list[str]:
    return [t for t in lra.split() if t not in ("(", ")")]


SMALL = listops.ListOpsSpec(
    min_length=5, max_length=60, max_depth=4, max_args=3, num_train=300, num_val=50, num_test=50
)


@pytest.fixture(scope="module")
def mini_splits():
    return listops.generate(listops.MINI)


# ---------------------------------------------------------------- generator
@pytest.mark.parametrize("spec", [SMALL, listops.MINI], ids=["small", "mini"])
def test_generator_respects_rules(spec, mini_splits):
    splits = mini_splits if spec is listops.MINI else listops.generate(spec)
    depths, arities = [], []
    for split, n in zip(listops.SPLITS, (spec.num_train, spec.num_val, spec.num_test), strict=True):
        exprs, labels = splits[split]
        assert len(exprs) == n == len(labels)
        for e, y in zip(exprs, labels, strict=True):
            toks = _strip(e)
            assert spec.min_length < len(toks) < spec.max_length
            t = _tree(toks)
            depths.append(_depth(t))
            arities += _arities(t)
            assert _lra_value(t) == y
    assert max(depths) <= spec.max_depth and min(arities) >= 2 and max(arities) <= spec.max_args
    if spec is SMALL:  # the limits bind: both are reached
        assert max(depths) == spec.max_depth and max(arities) == spec.max_args


def test_generator_full_lra_lengths():
    spec = dataclasses.replace(listops.FULL, num_train=30, num_val=0, num_test=0)
    exprs, labels = listops.generate(spec)["train"]
    lengths = [len(_strip(e)) for e in exprs]
    print("full-spec token lengths:", min(lengths), max(lengths))
    assert all(500 < n < 2000 for n in lengths)
    trees = [_tree(_strip(e)) for e in exprs]
    assert max(_depth(t) for t in trees) <= 10
    assert max(a for t in trees for a in _arities(t)) <= 10
    assert [_lra_value(t) for t in trees] == labels.tolist()


def test_examples_unique_and_label_distribution(mini_splits):
    everything = [e for s in listops.SPLITS for e in mini_splits[s][0]]
    assert len(set(everything)) == len(everything)
    for split in listops.SPLITS:
        counts = np.bincount(mini_splits[split][1], minlength=10)
        print(f"ListOps mini {split} label counts (0..9): {counts.tolist()}")
        assert counts.sum() == len(mini_splits[split][1])
    train_counts = np.bincount(mini_splits["train"][1], minlength=10)
    assert (train_counts > 0).all()


def test_same_seed_same_data():
    a = listops.generate(SMALL)
    b = listops.generate(SMALL)
    c = listops.generate(dataclasses.replace(SMALL, seed=1))
    for s in listops.SPLITS:
        assert a[s][0] == b[s][0] and np.array_equal(a[s][1], b[s][1])
    assert a["train"][0] != c["train"][0]


# ---------------------------------------------------------------- evaluator
TABLE = [
    ("7", 7),
    ("[MIN 3 1 4 ]", 1),
    ("[MAX 3 1 4 ]", 4),
    ("[SM 5 7 9 ]", 1),
    ("[MED 3 1 4 ]", 3),
    ("[MED 1 2 ]", 1),  # median 1.5 -> int -> 1
    ("[MED 3 8 ]", 5),  # 5.5 -> 5
    ("[MED 9 0 2 7 ]", 4),  # sorted 0 2 7 9: 4.5 -> 4
    ("[MED 4 4 6 6 ]", 5),
    ("[MED 0 9 ]", 4),
    ("[SM [MAX 7 9 ] 5 8 ]", 2),
    ("[MIN [SM 9 9 ] [MED 1 8 ] 7 ]", 4),
    ("[MAX [MIN 5 [SM 6 6 ] ] [MED 0 [MAX 1 3 ] 9 ] 2 ]", 3),
    ("[SM [SM [SM [SM 9 9 ] 9 ] 9 ] 9 ]", 5),
    ("[MED [SM 5 5 ] [MAX 8 1 ] [MIN 6 7 ] [MED 2 3 ] ]", 4),  # 0 8 6 2 -> 2 6: 4
    ("( ( ( [MAX 2 ) 9 ) ] )", 9),  # LRA's parenthesised form
    ("( ( ( [MED 1 ) ( ( ( [SM 4 ) 8 ) ] ) ) ] )", 1),  # MED(1, 2) = 1
]


@pytest.mark.parametrize(("expr", "value"), TABLE)
def test_evaluator_table(expr, value):
    assert listops.evaluate(expr) == value
    assert listops.evaluate(listops.to_lra_string(expr)) == value


@pytest.mark.parametrize("bad", ["[MAX 1 2", "]", "[FOO 1 ]", "[MAX ]", "1 2", "[MAX 10 2 ]", ""])
def test_evaluator_rejects_malformed(bad):
    with pytest.raises(ValueError):
        listops.evaluate(bad)


# ---------------------------------------------------------------- formats
def test_lra_string_and_tokenizer():
    assert listops.to_lra_string("[MAX 2 9 ]") == "( ( ( [MAX 2 ) 9 ) ] )"
    assert listops.to_lra_string("[SM [MIN 1 2 ] 3 ]") == (
        "( ( ( [SM ( ( ( [MIN 1 ) 2 ) ] ) ) 3 ) ] )"
    )
    assert listops.tokens("( ( ( [MAX 2 ) 9 ) ] )") == ["[MAX", "2", "9", "]"]
    ids = listops.encode("( ( ( [MAX 2 ) 9 ) ] )", 6)
    assert ids.dtype == np.int32 and ids.tolist() == [12, 3, 10, 15, 0, 0]
    # the vocabulary, as documented: pad 0, digits 1..10, MIN MAX MED SM 11..14, ] 15
    assert listops.VOCAB_SIZE == 16
    assert [listops.encode(t + " ]" if t in OPS else t, 1)[0] for t in listops.VOCAB[1:]] == list(
        range(1, 16)
    )
    assert listops.encode("[MIN 1 2 3 ]", 3).tolist() == [11, 2, 3]  # truncation


def test_tsv_round_trip(tmp_path, mini_splits):
    exprs, labels = mini_splits["val"]
    path = tmp_path / "basic_val.tsv"
    listops.write_tsv(path, exprs, labels)
    assert path.read_text().splitlines()[0] == "Source\tTarget"
    got_exprs, got_labels = listops.read_tsv(path)
    assert got_exprs == exprs and np.array_equal(got_labels, labels)
    ids, lengths = listops.encode_many(got_exprs, 128)
    assert ids.shape == (len(exprs), 128)
    for row, n, e in zip(ids, lengths, exprs, strict=True):
        toks = _strip(e)
        assert n == len(toks)
        assert [listops.VOCAB[i] for i in row[:n]] == toks and not row[n:].any()


def test_task_from_generated_cache_and_lra_files(tmp_path):
    cfg = {"variant": "mini", "data_dir": tmp_path, "num_train": 200, "num_val": 20}
    cfg["num_test"] = 20
    task = get_task("listops", cfg)
    assert (task.vocab_size, task.num_classes, task.seq_len, task.is_pair) == (16, 10, 128, False)
    assert {s: len(v) for s, v in task.splits.items()} == {"train": 200, "val": 20, "test": 20}
    cache = next((tmp_path / "listops").iterdir())
    assert sorted(p.name for p in cache.iterdir()) == [
        "basic_test.tsv",
        "basic_train.tsv",
        "basic_val.tsv",
        "spec.json",
    ]
    again = get_task("listops", cfg)  # read back from the cache
    assert np.array_equal(task.splits["val"].arrays["inputs"], again.splits["val"].arrays["inputs"])
    # the cache is in LRA's released layout: read it as an LRA release
    lra = get_task("listops", cfg, source="lra", listops_dir=cache)
    for s in listops.SPLITS:
        assert np.array_equal(lra.splits[s].arrays["inputs"], task.splits[s].arrays["inputs"])
        assert np.array_equal(lra.splits[s].arrays["targets"], task.splits[s].arrays["targets"])
    ex = task.splits["train"][0]
    assert ex["inputs"].shape == (128,) and ex["inputs"].dtype == np.int32
    assert ex["targets"].dtype == np.int32 and 0 <= ex["targets"] < 10


def test_missing_listops_errors(tmp_path):
    with pytest.raises(DatasetNotFoundError) as err:
        get_task("listops", {"data_dir": tmp_path, "source": "lra"})
    msg = str(err.value)
    assert isinstance(err.value, FileNotFoundError)
    assert "listops" in msg and str(tmp_path / "lra_release" / "listops-1000") in msg
    assert "lra_release" in msg and "python -m train.data.prepare listops" in msg
    with pytest.raises(DatasetNotFoundError, match="train.data.prepare listops"):
        get_task("listops", {"data_dir": tmp_path, "variant": "mini", "generate": False})
