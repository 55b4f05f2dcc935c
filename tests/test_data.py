"""train.data: batching and resumption, Text/Image via tfds mocks, Retrieval TSV, errors, CLI."""

from __future__ import annotations

import numpy as np
import pytest

from train.data import DatasetNotFoundError, Task, get_task, prepare
from train.data import tfds_tasks as tt
from train.data.pipeline import ArraySource
from train.data.tokenizers import CLS_ID, EOS_ID, decode_bytes, encode_bytes


def _toy_task(n: int = 12, seq_len: int = 3) -> Task:
    ids = np.arange(n)
    inputs = np.stack([ids * 10 + k for k in range(seq_len)], axis=1)
    return Task(
        name="toy",
        splits={"train": ArraySource({"inputs": inputs, "targets": ids}), "val": None},
        vocab_size=10 * n + seq_len,
        num_classes=n,
        seq_len=seq_len,
        is_pair=False,
    )


# ---------------------------------------------------------------- batching
def test_epochs_are_permutations_and_reshuffled():
    task = _toy_task(12)
    it = task.train_batches(4, seed=7)
    epochs = [np.concatenate([next(it)["targets"] for _ in range(3)]) for _ in range(3)]
    for e in epochs:
        assert sorted(e.tolist()) == list(range(12))
    assert not np.array_equal(epochs[0], epochs[1])  # each epoch is shuffled anew
    assert not np.array_equal(epochs[0], np.arange(12))


def test_batches_deterministic_and_resumable(tmp_path):
    task = get_task(
        "listops",
        {"variant": "mini", "data_dir": tmp_path, "num_train": 100, "num_val": 30, "num_test": 10},
    )
    first = task.train_batches(8, seed=3)
    run = [next(first) for _ in range(30)]  # 240 examples: crosses two epoch boundaries
    for b in run:
        assert b["inputs"].shape == (8, 128) and b["inputs"].dtype == np.int32
        assert b["targets"].shape == (8,) and b["targets"].dtype == np.int32
        assert 0 <= b["inputs"].min() and b["inputs"].max() < task.vocab_size
    again = task.train_batches(8, seed=3)
    for b, c in zip(run, (next(again) for _ in range(30)), strict=True):
        assert np.array_equal(b["inputs"], c["inputs"]) and np.array_equal(
            b["targets"], c["targets"]
        )
    resumed = task.train_batches(8, seed=3, start_step=17)
    for s in range(17, 30):
        b = next(resumed)
        assert np.array_equal(b["inputs"], run[s]["inputs"])
        assert np.array_equal(b["targets"], run[s]["targets"])
        assert np.array_equal(task.train_batch(s, 8, seed=3)["inputs"], run[s]["inputs"])
    other = task.train_batches(8, seed=4)
    assert not np.array_equal(next(other)["inputs"], run[0]["inputs"])
    # grain's iterator state works as well
    it = task.train_batches(8, seed=3, num_threads=2)
    for _ in range(5):
        next(it)
    state = it.get_state()
    nxt = next(it)
    assert np.array_equal(nxt["inputs"], run[5]["inputs"])  # threads do not change the order
    it.set_state(state)
    assert np.array_equal(next(it)["inputs"], run[5]["inputs"])


def test_processes_partition_the_global_batch():
    task = _toy_task(12)
    for step in range(5):
        whole = task.train_batch(step, 6, seed=1)["targets"]
        parts = [
            task.train_batch(step, 6, seed=1, process_index=p, process_count=3)["targets"]
            for p in range(3)
        ]
        assert np.array_equal(np.stack(parts, axis=1).reshape(-1), whole)
    with pytest.raises(ValueError, match="multiple of process_count"):
        task.train_batch(0, 5, process_count=2)


def test_eval_batches_cover_split_once_with_mask():
    task = _toy_task(10)
    batches = list(task.eval_batches("train", 4))
    assert len(batches) == 3 == task.num_eval_batches("train", 4)
    for b in batches:
        assert b["inputs"].shape == (4, 3) and b["mask"].dtype == bool
    assert batches[-1]["mask"].tolist() == [True, True, False, False]
    assert not batches[-1]["inputs"][2:].any()
    real = np.concatenate([b["targets"][b["mask"]] for b in batches])
    assert real.tolist() == list(range(10))
    parts = [list(task.eval_batches("train", 4, process_index=p, process_count=2)) for p in (0, 1)]
    got = sorted(
        int(t) for p in parts for b in p for t, m in zip(b["targets"], b["mask"], strict=True) if m
    )
    assert got == list(range(10))


def test_bad_arguments():
    task = _toy_task(4)
    with pytest.raises(KeyError, match="no split 'dev'"):
        task.eval_batches("dev", 2).__next__()
    with pytest.raises(ValueError, match="batch_size"):
        task.train_batch(0, 0)
    with pytest.raises(ValueError, match="seed"):
        task.train_batch(0, 2, seed=-1)
    with pytest.raises(ValueError, match="unknown task"):
        get_task("listopz", {})
    with pytest.raises(ValueError, match="variant"):
        get_task("listops", {"variant": "tiny"})


# ---------------------------------------------------------------- byte tokenizer
def test_byte_tokenizer():
    ids = encode_bytes("hé!", 8)
    assert ids.tolist() == [ord("h") + 1, 0xC3 + 1, 0xA9 + 1, ord("!") + 1, 0, 0, 0, 0]
    assert decode_bytes(ids) == "hé!".encode()
    ids = encode_bytes(b"abcdef", 5, add_cls=True, add_eos=True)
    assert ids.tolist() == [CLS_ID, 98, 99, 100, EOS_ID]
    assert decode_bytes(ids) == b"abc"
    with pytest.raises(ValueError, match="seq_len"):
        encode_bytes("a", 2, add_cls=True, add_eos=True)


# ---------------------------------------------------------------- text / image (tfds mocks)
def test_text_task_with_mock_data(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=12):
        task = get_task("text", {"data_dir": tmp_path, "seq_len": 48, "add_cls": True})
        raw = tfds.data_source("imdb_reviews", split="train", data_dir=str(tmp_path))
        assert (task.vocab_size, task.num_classes, task.seq_len) == (259, 2, 48)
        assert {s: len(v) for s, v in task.splits.items()} == {"train": 12, "val": 12, "test": 12}
        for i in range(12):
            ex = task.splits["train"][i]
            text = raw[i]["text"]
            text = text.encode() if isinstance(text, str) else text
            assert ex["inputs"][0] == CLS_ID
            assert decode_bytes(ex["inputs"]) == text[:47]
            assert ex["targets"] == raw[i]["label"]
        batch = next(task.train_batches(4, seed=0, num_threads=2))
        assert batch["inputs"].shape == (4, 48) and batch["targets"].dtype == np.int32
        mini = get_task("text", {"data_dir": tmp_path, "variant": "mini", "num_train": 5})
        assert len(mini.splits["train"]) == 5 and mini.seq_len == 512
        # LRA's setting: byte ids + 1 (vocab 257, no specials), 4000 tokens for "4K"
        full = get_task("text", {"data_dir": tmp_path})
        assert (full.vocab_size, full.seq_len) == (257, 4000)
        ex = full.splits["train"][0]["inputs"]
        assert ex.shape == (4000,) and 1 <= ex[0] <= 256 and ex.max() < 257


def test_gray_conversion_matches_tf_formula():
    rgb = np.array(
        [[[0, 0, 0], [255, 255, 255], [255, 0, 0], [0, 255, 0], [0, 0, 255], [100, 150, 200]]],
        np.uint8,
    )
    # trunc((0.2989 R + 0.5870 G + 0.1140 B) / 255 * 255.5), worked by hand
    assert tt.to_gray(rgb).tolist() == [[0, 255, 76, 149, 29, 141]]
    assert tt.pool(np.array([[0, 1], [2, 3]], np.uint8), 2).tolist() == [[2]]  # 1.5 -> 2


def test_image_task_with_mock_data(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=20):
        task = get_task("image", {"data_dir": tmp_path})
        raw = tfds.data_source("cifar10", split="train", data_dir=str(tmp_path))
        assert (task.vocab_size, task.num_classes, task.seq_len) == (256, 10, 1024)
        assert {s: len(v) for s, v in task.splits.items()} == {"train": 18, "val": 2, "test": 20}
        ex = task.splits["val"][1]  # val = the last 10% of train
        want = tt.to_gray(raw[19]["image"]).reshape(-1)
        assert np.array_equal(ex["inputs"], want) and ex["targets"] == raw[19]["label"]
        mini = get_task("image", {"data_dir": tmp_path, "variant": "mini"})
        ex = mini.splits["train"][0]
        assert mini.seq_len == 256 and ex["inputs"].shape == (256,)
        want = tt.pool(tt.to_gray(raw[0]["image"]), 2).reshape(-1)
        assert np.array_equal(ex["inputs"], want)
        b = mini.train_batch(0, 4)
        assert b["inputs"].shape == (4, 256) and b["inputs"].max() <= 255


@pytest.mark.parametrize(("name", "tfds_name"), [("text", "imdb_reviews"), ("image", "cifar10")])
def test_missing_tfds_data(tmp_path, name, tfds_name):
    with pytest.raises(DatasetNotFoundError) as err:
        get_task(name, {"data_dir": tmp_path})
    msg = str(err.value)
    assert tfds_name in msg and str(tmp_path / tfds_name) in msg
    assert f"tfds build {tfds_name} --data_dir {tmp_path} --file_format array_record" in msg


# ---------------------------------------------------------------- retrieval
AAN_ROWS = [
    "1.0\tp1\tp2\tAttention is all you need.\tNeural machine translation by jointly\n",
    '0.0\tp3\tp4\t"Quoted" text, commas\tÜnïcödé bytes\n',
    "1.0\tp5\tp6\tshort\ta much longer second document that will be truncated\n",
    "0.0\tp7\tp8\tx\ty\n",
]


def _write_aan(folder, rows=AAN_ROWS):
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "eval", "test"):
        (folder / f"new_aan_pairs.{split}.tsv").write_text("".join(rows), encoding="utf-8")


def test_retrieval_reader(tmp_path):
    _write_aan(tmp_path / "lra_release" / "lra_release" / "tsv_data")
    task = get_task("retrieval", {"data_dir": tmp_path, "seq_len": 16})
    assert task.is_pair and task.input_keys == ("inputs1", "inputs2")
    assert (task.vocab_size, task.num_classes, task.seq_len) == (259, 2, 16)
    assert {s: len(v) for s, v in task.splits.items()} == {"train": 4, "val": 4, "test": 4}
    for i, line in enumerate(AAN_ROWS):
        label, _, _, t1, t2 = line.rstrip("\n").split("\t")
        ex = task.splits["val"][i]
        assert decode_bytes(ex["inputs1"]) == t1.encode()[:16]
        assert decode_bytes(ex["inputs2"]) == t2.encode()[:16]
        assert ex["targets"] == int(float(label))
    b = next(task.train_batches(2, seed=0))
    assert set(b) == {"inputs1", "inputs2", "targets"}
    assert b["inputs1"].shape == b["inputs2"].shape == (2, 16)
    eb = next(task.eval_batches("test", 3))
    assert set(eb) == {"inputs1", "inputs2", "targets", "mask"}


def test_retrieval_rejects_malformed(tmp_path):
    _write_aan(tmp_path / "aan", AAN_ROWS + ["1.0\tonly\tfour\tcolumns\n"])
    with pytest.raises(ValueError, match="5 tab-separated columns"):
        get_task("retrieval", {"aan_dir": tmp_path / "aan"})


def test_missing_retrieval(tmp_path):
    with pytest.raises(DatasetNotFoundError) as err:
        get_task("retrieval", {"data_dir": tmp_path})
    msg = str(err.value)
    assert "AAN" in msg and "new_aan_pairs" in msg and "lra_release/tsv_data" in msg
    assert str(tmp_path / "lra_release" / "lra_release" / "tsv_data") in msg


# ---------------------------------------------------------------- config and CLI
def test_configdict_and_cli(tmp_path, capsys):
    ml_collections = pytest.importorskip("ml_collections")
    cfg = ml_collections.ConfigDict(
        {"data_dir": str(tmp_path), "variant": "mini", "batch_size": 4, "model": {"d": 8}}
    )
    assert prepare.main(["listops", "--data_dir", str(tmp_path), "--variant", "mini"]) == 0
    out = capsys.readouterr().out
    assert "label counts" in out
    task = get_task("listops", cfg)
    assert task.batch_size == 4 and task.train_batch(0)["inputs"].shape == (4, 128)
    assert prepare.main(["retrieval", "--data_dir", str(tmp_path)]) == 1
    assert "new_aan_pairs" in capsys.readouterr().err
