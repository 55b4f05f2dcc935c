"""Pathfinder: balanced labels, label = pixel connectivity, PNG grid, cache, release reader."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from PIL import Image

from train.data import DatasetNotFoundError, get_task, pathfinder

FULL_SAMPLE = dataclasses.replace(pathfinder.FULL, num_train=160, num_val=20, num_test=20)
MINI_SAMPLE = dataclasses.replace(pathfinder.MINI, num_train=160, num_val=20, num_test=20)


@pytest.fixture(scope="module", params=[FULL_SAMPLE, MINI_SAMPLE], ids=["32px_len14", "mini"])
def generated(request):
    return request.param, pathfinder.generate(request.param)


def test_flood_fill_on_hand_drawn_images():
    img = np.zeros((12, 12), np.uint8)
    img[2, [1, 2, 4, 5, 7, 8]] = 255  # dashes with 1-pixel gaps: one path
    assert pathfinder.endpoints_connected(img, (2, 1), (2, 8))
    img[5, 1:9] = 255  # a second line 3 rows below: never linked to the first
    assert not pathfinder.endpoints_connected(img, (2, 1), (5, 8))
    img2 = np.zeros((12, 12), np.uint8)
    img2[3, [1, 2, 6, 7]] = 255  # a 3-pixel gap breaks the path
    assert not pathfinder.endpoints_connected(img2, (3, 1), (3, 7))
    assert pathfinder.endpoints_connected(img2, (3, 1), (3, 7), link_radius=4)
    img2[4, [3, 5]] = 128  # diagonal stepping stones within radius 2
    assert pathfinder.endpoints_connected(img2, (3, 1), (3, 7))
    assert not pathfinder.endpoints_connected(img2, (3, 1), (0, 0))  # off pixel


def test_balanced_labels_and_shapes(generated):
    spec, splits = generated
    for split, n in zip(
        pathfinder.SPLITS, (spec.num_train, spec.num_val, spec.num_test), strict=True
    ):
        d = splits[split]
        s = spec.image_size
        assert d["images"].shape == (n, s, s) and d["images"].dtype == np.uint8
        assert np.bincount(d["labels"], minlength=2).tolist() == [n // 2, n // 2]
        assert set(np.unique(d["images"]).tolist()) == {0, 255}


def test_label_is_connectivity(generated):
    """Flood fill along drawn pixels from marker 1 reaches marker 2 iff label == 1."""
    spec, splits = generated
    d = splits["train"]
    agree = [
        pathfinder.endpoints_connected(img, tuple(m[0]), tuple(m[1])) == bool(y)
        for img, m, y in zip(d["images"], d["markers"], d["labels"], strict=True)
    ]
    assert all(agree), f"{agree.count(False)} of {len(agree)} labels disagree with pixels"
    # the markers are drawn disks (3x3 blocks) on "on" pixels
    for img, m in zip(d["images"][:20], d["markers"][:20], strict=True):
        for y, x in m:
            assert (img[y - 1 : y + 2, x - 1 : x + 2] == 255).all()


def test_same_seed_same_images():
    a = pathfinder.generate(dataclasses.replace(MINI_SAMPLE, num_train=40))
    b = pathfinder.generate(dataclasses.replace(MINI_SAMPLE, num_train=40))
    c = pathfinder.generate(dataclasses.replace(MINI_SAMPLE, num_train=40, seed=3))
    for s in pathfinder.SPLITS:
        for k in ("images", "labels", "markers"):
            assert np.array_equal(a[s][k], b[s][k])
    assert not np.array_equal(a["train"]["images"], c["train"]["images"])
    # a split does not depend on the sizes of the others
    d = pathfinder.generate(dataclasses.replace(MINI_SAMPLE, num_train=40, num_val=2))
    assert np.array_equal(a["test"]["images"], d["test"]["images"])


def test_example_grid_png(tmp_path, generated):
    spec, splits = generated
    d = splits["test"]
    path = tmp_path / "grid.png"
    grid = pathfinder.save_grid(path, d["images"][:12], d["labels"][:12], cols=4)
    s = spec.image_size
    assert grid.shape == (3 * (s + 4), 4 * (s + 2))
    with Image.open(path) as im:
        back = np.asarray(im)
    assert back.shape == grid.shape and np.array_equal(back, grid)
    assert np.array_equal(back[1 : 1 + s, 1 : 1 + s], d["images"][0])
    big = pathfinder.save_grid(
        tmp_path / "big.png", d["images"][:12], d["labels"][:12], cols=4, scale=2
    )
    assert big.shape == (2 * 3 * (s + 4), 2 * 4 * (s + 2))
    assert np.array_equal(big[::2, ::2], grid)


def test_task_from_cache(tmp_path):
    cfg = {"variant": "mini", "data_dir": tmp_path, "num_train": 40, "num_val": 10}
    task = get_task("pathfinder", cfg, num_test=10)
    assert (task.vocab_size, task.num_classes, task.seq_len, task.is_pair) == (256, 2, 256, False)
    again = get_task("pathfinder", cfg, num_test=10)
    for s in pathfinder.SPLITS:
        assert np.array_equal(task.splits[s].arrays["inputs"], again.splits[s].arrays["inputs"])
    ex = task.splits["train"][3]
    assert ex["inputs"].shape == (256,) and ex["inputs"].dtype == np.int32
    assert task.info["label_counts"]["train"] == [20, 20]
    with pytest.raises(ValueError, match="seq_len"):
        get_task("pathfinder", cfg, num_test=10, seq_len=1024)


def _fake_release(root, n: int = 10):
    """pathfinder32/curv_contour_length_14/{imgs/0/sample_j.png, metadata/0.npy} + 1 empty."""
    base = root / "pathfinder32" / "curv_contour_length_14"
    (base / "imgs" / "0").mkdir(parents=True)
    (base / "metadata").mkdir()
    rng = np.random.default_rng(0)
    lines, pixels = [], {}
    for j in range(n):
        img = rng.integers(0, 256, size=(32, 32), dtype=np.uint8)
        Image.fromarray(img, mode="L").save(base / "imgs" / "0" / f"sample_{j}.png")
        pixels[j] = img
        lines.append(f"imgs/0 sample_{j}.png {j} {j % 2} 14 2 0.75")
    (base / "imgs" / "0" / f"sample_{n}.png").write_bytes(b"")  # empty, as in the release
    lines.append(f"imgs/0 sample_{n}.png {n} 1 14 2 0.75")
    (base / "metadata" / "0.npy").write_text("\n".join(lines) + "\n")
    return pixels


def test_release_reader(tmp_path):
    pixels = _fake_release(tmp_path / "lra_release")
    task = get_task("pathfinder", {"data_dir": tmp_path, "source": "lra"})
    assert task.seq_len == 1024 and task.info["difficulty"] == "hard"
    sizes = {s: len(v) for s, v in task.splits.items()}
    assert sizes == {"train": 8, "val": 1, "test": 1}  # 80/10/10 of the 10 non-empty images
    seen = set()
    for split in pathfinder.SPLITS:
        src = task.splits[split]
        for i in range(len(src)):
            ex = src[i]
            path, label = src.raw[int(src.indices[i])]
            j = int(path.rsplit("sample_", 1)[1].split(".")[0])
            assert np.array_equal(ex["inputs"], pixels[j].reshape(-1).astype(np.int32))
            assert ex["targets"] == j % 2 == label
            seen.add(j)
    assert seen == set(range(10))


def test_missing_pathfinder_errors(tmp_path):
    with pytest.raises(DatasetNotFoundError) as err:
        get_task("pathfinder", {"data_dir": tmp_path, "source": "lra", "difficulty": "easy"})
    msg = str(err.value)
    assert "pathfinder32 easy" in msg and "curv_baseline" in msg and "lra_release" in msg
    with pytest.raises(DatasetNotFoundError, match="train.data.prepare pathfinder"):
        get_task("pathfinder", {"data_dir": tmp_path, "variant": "mini", "generate": False})
