"""Pathfinder: the snakes generator (construction, no cheap label feature), cache, reader."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from PIL import Image

from train.data import DatasetNotFoundError, get_task, pathfinder, snakes

FULL_SAMPLE = dataclasses.replace(pathfinder.FULL, num_train=160, num_val=20, num_test=20)
MINI_SAMPLE = dataclasses.replace(pathfinder.MINI, num_train=160, num_val=20, num_test=20)


@pytest.fixture(scope="module", params=[FULL_SAMPLE, MINI_SAMPLE], ids=["32px_len14", "mini"])
def generated(request):
    return request.param, pathfinder.generate(request.param)


def test_auc_helper():
    y = np.arange(200) % 2
    auc = pathfinder.auc
    assert auc(y.astype(float), y) == 1.0 and auc(-y.astype(float), y) == 0.0
    assert auc(np.ones(200), y) == 0.5


def test_markers_connected():
    """4-connected ink above the threshold joins the markers; a gap or a diagonal does not."""
    img = np.zeros((4, 6, 6), dtype=np.uint8)
    img[0, 2, 1:5] = 40  # a line
    img[1, 2, 1:5] = 40
    img[1, 2, 3] = 0  # with a gap
    img[2, 2, 1:3] = img[2, 3, 3:5] = 40  # touching only diagonally
    img[3, 2, 1:5] = 40  # faint ink, below the threshold used below
    markers = np.array([[[2, 1], [2, 4]], [[2, 1], [2, 4]], [[2, 1], [3, 4]], [[2, 1], [2, 4]]])
    got = pathfinder.markers_connected(img, markers.astype(np.float32))
    assert got.tolist() == [True, False, False, True]
    assert not pathfinder.markers_connected(img[3:], markers[3:], threshold=41)[0]


def test_render_is_antialiased():
    """One horizontal paddle and one marker: coverage = clip(half + 0.5 - distance, 0, 1)."""
    spec = pathfinder.FULL
    seg = np.array([[[[5.0, 3.0], [5.0, 5.0]], [[20.0, 20.0], [20.0, 20.0]]]])
    values = np.array([[0.75, 0.75], [1.5, 1.0]])
    img = snakes._render(spec, seg, values)[0].astype(int)
    assert img[5, 4] == round(0.75 * 255) and img[6, 4] == round(0.25 * 0.75 * 255)
    assert img[7, 4] == 0 and img[5, 6] == round(0.25 * 0.75 * 255)
    assert img[20, 20] == 255 and img[21, 21] == round((2.0 - np.sqrt(2)) * 255)
    assert img[22, 20] == 0
    assert img[4, 2] == 0 and img[22, 22] == 0  # distance sqrt(2) > 1.25; 2.83 > 2
    assert (img > 0).sum() == (3 * 3 + 2) + 3 * 3  # paddle (rows 4-6 x cols 3-5, 2 ends), disk


def test_balanced_labels_and_shapes(generated):
    spec, splits = generated
    for split, n in zip(
        pathfinder.SPLITS, (spec.num_train, spec.num_val, spec.num_test), strict=True
    ):
        d = splits[split]
        s = spec.image_size
        assert d["images"].shape == (n, s, s) and d["images"].dtype == np.uint8
        assert np.bincount(d["labels"], minlength=2).tolist() == [n // 2, n // 2]
    levels = np.unique(splits["train"]["images"])
    assert len(levels) > 16, f"only {len(levels)} grey levels: not antialiased"
    # markers (contrast 1) are the brightest ink, main contours 0.75, distractors 1
    assert levels.max() == 255


def test_label_from_construction(generated):
    """Marker 0 sits on the origin of contour o, marker 1 on the terminal tip of contour o
    (label 1) or of the other main contour (label 0); the origins are seed_distance apart."""
    spec, splits = generated
    d = splits["train"]
    rows = np.arange(len(d["labels"]))
    o = d["origin"].astype(int)
    target = np.where(d["labels"] == 1, o, 1 - o)
    assert np.array_equal(d["markers"][:, 0], d["tips"][rows, o, 0])
    assert np.array_equal(d["markers"][:, 1], d["tips"][rows, target, 1])
    gap = np.linalg.norm(d["tips"][:, 0, 0] - d["tips"][:, 1, 0], axis=-1)
    assert np.all(np.abs(gap - spec.seed_distance) <= np.sqrt(0.5) + 1e-5)
    # marker centres are drawn at full contrast
    centres = np.rint(d["markers"]).astype(int)
    for m in range(2):
        assert (d["images"][rows, centres[:, m, 0], centres[:, m, 1]] >= 200).all()
    assert np.all(d["distractors"] <= spec.num_distractors)
    # most distractors find room (4.87 of 5 measured at 2000 full images; mini has none)
    assert d["distractors"].mean() >= 0.75 * spec.num_distractors


def test_contours_follow_the_construction():
    """Main contours: the paddle spacing and turns of the growth rule, inside the image, apart
    from each other; distractors touch or cross them in many images (so a flood fill from
    the pixels would not recover the label, which is why the label comes from the
    construction)."""
    spec = FULL_SAMPLE
    n = 200
    out = pathfinder.generate_images(
        spec, np.arange(n) % 2, np.random.default_rng(5), keep_paddles=True
    )
    mains, dis = out["main_paddles"], out["distractor_paddles"]
    length = np.linalg.norm(mains[..., 1, :] - mains[..., 0, :], axis=-1)
    assert np.allclose(length, spec.paddle_length)
    assert ((mains >= 0) & (mains <= spec.image_size - 1)).all()
    # tail of paddle j+1 is ~2 * margin past the head of paddle j (exactly for a straight
    # continuation, less when turning): within [margin * sqrt(2), 2 * margin] + rounding
    gap = np.linalg.norm(mains[:, :, 1:, 0] - mains[:, :, :-1, 1], axis=-1)
    assert gap.min() >= spec.margin * np.sqrt(2) - 1e-6 and gap.max() <= 2 * spec.margin + 1e-6
    # turns between consecutive paddles below 90 degrees (continuity 1)
    direction = mains[..., 1, :] - mains[..., 0, :]
    cos = (direction[:, :, 1:] * direction[:, :, :-1]).sum(-1) / spec.paddle_length**2
    assert cos.min() > -1e-9
    # paddles of different contours keep `separation` between their centre lines, and the
    # tips (where markers go) `marker_separation` (Linsley's non-overlapping masks)
    flat = mains.reshape(n, -1, 2, 2)
    a_tail, a_head = mains[:, 0, :, 0], mains[:, 0, :, 1]
    assert snakes._body_gap(a_tail, a_head, mains[:, 1]).min() > spec.separation
    drawn = dis[..., 0, 0] < 1e3
    assert drawn.mean() > 0.9
    d_tail, d_head = dis[..., 0, :].reshape(n, -1, 2), dis[..., 1, :].reshape(n, -1, 2)
    gap = snakes._body_gap(d_tail, d_head, flat).reshape(drawn.shape)
    assert gap[drawn].min() > spec.separation
    tips = np.concatenate([mains[:, :, 0, 0], mains[:, :, -1, 1]], axis=1)
    tip_gap = snakes._body_gap(d_tail, d_head, np.repeat(tips[:, :, None], 2, axis=2))
    assert tip_gap.reshape(drawn.shape)[drawn].min() > spec.marker_separation
    # ... but distractors may touch and cross each other (ink overlaps in many images)
    other = np.concatenate([dis[:, 1:], dis[:, :1]], axis=1).reshape(n, -1, 2, 2)
    near = snakes._body_gap(d_tail[:, :4], d_head[:, :4], other) < spec.paddle_thickness
    assert near.any(axis=1).mean() > 0.05


@pytest.mark.parametrize(
    ("spec", "n"), [(pathfinder.MINI, 2000), (pathfinder.FULL, 1000)], ids=["mini", "32px_len14"]
)
def test_label_visible_and_no_cheap_feature(spec, n):
    """The label can be read from the picture: the markers are joined by ink (4-connected,
    any grey level > 0) exactly when the label is 1, in >= 97% of the images (measured
    100.0% for both; the first snakes version, where distractors crossed the main contours
    and the main contours touched, was at 55-69%). Marker distance and ink amount are at
    chance (AUC 0.5 +- 0.05; the AUC's standard error is 0.013 at 2000 balanced examples,
    0.018 at 1000: full images are slow to draw; the old generator failed this with a
    distance AUC of 0.66)."""
    got = pathfinder.measure(spec, n, seed=11)
    assert got["label_visible"] >= 0.97, got
    for name in ("auc_marker_distance", "auc_ink"):
        assert abs(got[name] - 0.5) < 0.05, f"{name} predicts the label: {got}"


def test_same_seed_same_images():
    a = pathfinder.generate(dataclasses.replace(MINI_SAMPLE, num_train=40))
    b = pathfinder.generate(dataclasses.replace(MINI_SAMPLE, num_train=40))
    c = pathfinder.generate(dataclasses.replace(MINI_SAMPLE, num_train=40, seed=3))
    for s in pathfinder.SPLITS:
        assert a[s].keys() == b[s].keys()
        for k in a[s]:
            assert np.array_equal(a[s][k], b[s][k])
    assert not np.array_equal(a["train"]["images"], c["train"]["images"])
    # a split does not depend on the sizes of the others
    d = pathfinder.generate(dataclasses.replace(MINI_SAMPLE, num_train=40, num_val=2))
    assert np.array_equal(a["test"]["images"], d["test"]["images"])


def test_specs_and_sizes():
    x = pathfinder.generate_images(
        dataclasses.replace(pathfinder.PATHX, num_distractors=2),
        np.array([0, 1]),
        np.random.default_rng(0),
    )
    assert x["images"].shape == (2, 128, 128) and len(np.unique(x["images"])) > 16
    easy = pathfinder.difficulty_spec("easy")
    assert (easy.contour_length, easy.distractor_length, easy.num_distractors) == (6, 2, 10)
    assert pathfinder.difficulty_spec("intermediate").num_distractors == 6
    spec = pathfinder.spec_from_config({"difficulty": "intermediate", "data_seed": 4})
    assert (spec.contour_length, spec.seed, spec.image_size) == (9, 4, 32)
    assert pathfinder.spec_from_config({"variant": "mini", "image_size": 20}).image_size == 20
    with pytest.raises(ValueError, match="difficulty"):
        pathfinder.difficulty_spec("medium")
    with pytest.raises(ValueError, match="seed_distance"):
        pathfinder.PathfinderSpec(image_size=12, seed_distance=7)
    with pytest.raises(ValueError, match="even"):
        pathfinder.PathfinderSpec(num_train=3)
    with pytest.raises(ValueError, match="labels"):
        pathfinder.generate_images(pathfinder.MINI, np.array([0, 2]), np.random.default_rng(0))


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
    assert (task.vocab_size, task.num_classes, task.seq_len, task.is_pair) == (256, 2, 144, False)
    again = get_task("pathfinder", cfg, num_test=10)
    for s in pathfinder.SPLITS:
        assert np.array_equal(task.splits[s].arrays["inputs"], again.splits[s].arrays["inputs"])
    ex = task.splits["train"][3]
    assert ex["inputs"].shape == (144,) and ex["inputs"].dtype == np.int32
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


def test_configs_reach_the_generator():
    from train import configs
    from train.data import _config

    def spec(preset, *overrides):
        c = configs.get_config("pathfinder", preset)
        configs.apply_overrides(c, overrides)
        return pathfinder.spec_from_config(_config.as_dict(c.data))

    assert spec("mini") == pathfinder.MINI and spec("full") == pathfinder.FULL
    assert spec("pathx") == pathfinder.PATHX
    assert spec("full", "data.difficulty=easy") == pathfinder.difficulty_spec("easy")
    got = spec("mini", "data.contour_length=5", "data.seed_distance=3", "data.data_seed=2")
    assert got == dataclasses.replace(pathfinder.MINI, contour_length=5, seed_distance=3, seed=2)
    with pytest.raises(ValueError, match="presets"):
        configs.get_config("pathfinder", "huge")
