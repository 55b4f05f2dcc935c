"""train.data.augment: DeiT's RandAugment (``rand-m9-mstd0.5-inc1``) and random erasing, op by op
and inside the `ImageTask` training stream."""

from __future__ import annotations

import math

import numpy as np
import pytest

from train import configs
from train.data import augment, images

FILL = augment.RAND_AUGMENT_FILL
ENHANCE = ("Color", "Contrast", "Brightness", "Sharpness")


def _image(shape=(24, 32, 3), seed=0):
    return np.random.default_rng(seed).integers(0, 256, shape).astype(np.uint8)


# ---------------------------------------------------------------- RandAugment
@pytest.mark.parametrize("channels", [1, 3])
def test_rand_augment_deterministic_shape_dtype(channels):
    img = _image((24, 32, channels))
    outs = [augment.rand_augment(img, np.random.default_rng(s)) for s in range(8)]
    for s, out in enumerate(outs):
        assert out.shape == img.shape and out.dtype == np.uint8
        np.testing.assert_array_equal(out, augment.rand_augment(img, np.random.default_rng(s)))
    assert sum(not np.array_equal(out, img) for out in outs) >= 4  # P(identity) ~ 1/4
    # different seeds -> different ops / magnitudes / signs (prob 1: both ops applied)
    outs = [augment.rand_augment(img, np.random.default_rng(s), prob=1) for s in range(8)]
    assert len({out.tobytes() for out in outs}) == 8
    # prob 0: nothing applied; every op (all magnitudes) keeps shape and dtype
    np.testing.assert_array_equal(augment.rand_augment(img, np.random.default_rng(0), prob=0), img)
    for op in augment.RAND_AUGMENT_OPS:
        out = augment.rand_augment_op(img, op, 10, negate=True)
        assert out.shape == img.shape and out.dtype == np.uint8, op


def test_rand_augment_sampling(monkeypatch):
    """Ops uniform with replacement, each applied with probability 1/2, magnitudes
    N(9, 0.5) clipped to [0, 10], random signs (seen through the arguments the ops get)."""
    calls = []

    def spy(pil, op, arg, fill):
        calls.append((op, arg))
        return pil

    monkeypatch.setattr(augment, "_apply_op", spy)
    img = _image((8, 8, 3))
    for s in range(300):
        augment.rand_augment(img, np.random.default_rng(s))
    assert abs(len(calls) / 600 - 0.5) < 5 * math.sqrt(0.25 / 600)
    assert {op for op, _ in calls} == set(augment.RAND_AUGMENT_OPS)
    rot = np.asarray([arg for op, arg in calls if op == "Rotate"])
    assert (rot > 0).any() and (rot < 0).any() and np.all(np.abs(rot) <= 30)
    assert abs(np.abs(rot).mean() - 27) < 5 * 1.5 / math.sqrt(len(rot))  # 3 m, std 1.5
    calls.clear()  # magnitude_std 0: exactly the magnitude; prob 1: always applied
    for s in range(100):
        augment.rand_augment(
            img, np.random.default_rng(s), num_ops=1, magnitude=5, magnitude_std=0, prob=1
        )
    assert len(calls) == 100
    for op, arg in calls:
        assert arg in (augment.rand_augment_arg(op, 5), augment.rand_augment_arg(op, 5, True))
    calls.clear()  # N(10, 5): clipped to [0, 10], so arguments stay in their ranges
    for s in range(100):
        augment.rand_augment(
            img, np.random.default_rng(s), num_ops=3, magnitude=10, magnitude_std=5, prob=1
        )
    args = {}
    for op, arg in calls:
        args.setdefault(op, []).append(arg)
    bounds = {
        "Rotate": 30,
        "ShearX": 0.3,
        "ShearY": 0.3,
        "TranslateXRel": 0.45,
        "TranslateYRel": 0.45,
    }
    for op, bound in bounds.items():
        assert np.max(np.abs(args[op])) == pytest.approx(bound), op  # m = 10 is hit
    assert min(args["PosterizeIncreasing"]) == 0 and max(args["PosterizeIncreasing"]) <= 4
    assert min(args["SolarizeIncreasing"]) == 0 and max(args["SolarizeAdd"]) == 110
    assert 0.1 <= min(args["BrightnessIncreasing"]) and max(args["BrightnessIncreasing"]) <= 1.9


@pytest.mark.parametrize("op", ["Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel"])
def test_geometric_ops_identity_at_magnitude_zero(op):
    img = _image()
    for negate in (False, True):
        np.testing.assert_array_equal(augment.rand_augment_op(img, op, 0, negate=negate), img)


@pytest.mark.parametrize(
    "op", ["SolarizeIncreasing", "SolarizeAdd"] + [f"{x}Increasing" for x in ENHANCE]
)
def test_photometric_ops_identity_at_magnitude_zero(op):
    img = _image()
    np.testing.assert_array_equal(augment.rand_augment_op(img, op, 0), img)


def test_invert_autocontrast_equalize():
    img = _image()
    inv = augment.rand_augment_op(img, "Invert", 9)
    np.testing.assert_array_equal(inv, 255 - img)
    np.testing.assert_array_equal(augment.rand_augment_op(inv, "Invert", 3), img)
    low = (50 + _image() // 5).astype(np.uint8)  # values in [50, 101]
    ac = augment.rand_augment_op(low, "AutoContrast", 9)
    assert ac.min(axis=(0, 1)).tolist() == [0, 0, 0]
    assert ac.max(axis=(0, 1)).tolist() == [255, 255, 255]
    # equalize: an order-preserving per-channel map spreading the values to the full range
    eq = augment.rand_augment_op(low, "Equalize", 9)
    assert eq[..., 0].max() == 255
    for c in range(3):
        order = np.argsort(low[..., c], axis=None, kind="stable")
        assert np.all(np.diff(eq[..., c].reshape(-1)[order].astype(int)) >= 0)


def test_solarize_posterize_solarize_add():
    img = _image()
    # magnitude 9: invert pixels >= 256 - int(0.9 * 256) = 26
    sol = augment.rand_augment_op(img, "SolarizeIncreasing", 9)
    np.testing.assert_array_equal(sol, np.where(img >= 26, 255 - img, img))
    # posterize keeps the top 4 - int(4 m / 10) bits: m 9 -> 1, m 5 -> 2, m 10 -> 0 (black)
    for m, mask in [(9, 0x80), (5, 0xC0), (0, 0xF0), (10, 0x00)]:
        np.testing.assert_array_equal(
            augment.rand_augment_op(img, "PosterizeIncreasing", m), img & mask
        )
    add = augment.rand_augment_op(img, "SolarizeAdd", 9)  # + int(0.9 * 110) = 99 below 128
    want = np.where(img < 128, np.minimum(img.astype(int) + 99, 255), img)
    np.testing.assert_array_equal(add, want)


def test_enhance_ops():
    flat = np.full((16, 16, 3), 100, np.uint8)
    # brightness: factor 1 +- 0.81 at magnitude 9
    assert np.all(augment.rand_augment_op(flat, "BrightnessIncreasing", 9) == 181)
    assert np.all(augment.rand_augment_op(flat, "BrightnessIncreasing", 9, negate=True) == 19)
    # colour: grey is unchanged; saturation (channel spread) scales by the factor
    np.testing.assert_array_equal(augment.rand_augment_op(flat, "ColorIncreasing", 9), flat)
    colour = np.broadcast_to(np.asarray([200, 100, 50], np.uint8), (16, 16, 3))
    grey = augment.rand_augment_op(colour, "ColorIncreasing", 9, negate=True)
    assert abs(int(np.ptp(grey[0, 0])) - 0.19 * 150) <= 2
    # contrast: a two-level image's spread scales by the factor about the grey mean
    two = np.zeros((16, 16, 3), np.uint8) + 100
    two[:, 8:] = 140
    for negate, factor in ((False, 1.81), (True, 0.19)):
        out = augment.rand_augment_op(two, "ContrastIncreasing", 9, negate=negate)
        assert abs(int(out[0, 15, 0]) - int(out[0, 0, 0]) - factor * 40) <= 2
    # sharpness: blurs (0.19) or sharpens (1.81) the interior of a noise image
    noise = _image((16, 16, 3))
    inner = (slice(1, -1), slice(1, -1))
    std = noise[inner].astype(float).std()
    assert augment.rand_augment_op(noise, "SharpnessIncreasing", 9, negate=True)[inner].std() < std
    assert augment.rand_augment_op(noise, "SharpnessIncreasing", 9)[inner].std() > std


@pytest.mark.parametrize("channels", [1, 3])
def test_translate_shifts_by_the_fraction_of_the_size(channels):
    """Magnitude 10 moves 0.45 of the size: 9 of 20 columns, 18 of 40 rows; fill enters."""
    img = _image((40, 20, channels))
    fill = np.asarray(FILL if channels == 3 else [round(sum(FILL) / len(FILL))], np.uint8)
    x = augment.rand_augment_op(img, "TranslateXRel", 10)  # content moves left by 9
    np.testing.assert_array_equal(x[:, :11], img[:, 9:])
    assert np.all(x[:, 11:] == fill)
    x = augment.rand_augment_op(img, "TranslateXRel", 10, negate=True)
    np.testing.assert_array_equal(x[:, 9:], img[:, :11])
    assert np.all(x[:, :9] == fill)
    y = augment.rand_augment_op(img, "TranslateYRel", 10, negate=True)  # down by 18
    np.testing.assert_array_equal(y[18:], img[:22])
    assert np.all(y[:18] == fill)
    # magnitude 9 on the 20-wide image: 0.405 * 20 = 8.1 columns (interpolated)
    ramp = np.broadcast_to(np.arange(0, 200, 10, dtype=np.uint8)[None, :, None], (4, 20, 3))
    out = augment.rand_augment_op(np.ascontiguousarray(ramp), "TranslateXRel", 9)
    np.testing.assert_allclose(out[0, 2:9, 0], ramp[0, 2:9, 0] + 81, atol=1)


def test_shear_slants_a_line_about_the_top_left():
    """ShearX at magnitude 10 (0.3): output (x, y) samples input (x + 0.3 (y + 1/2), y), so a
    vertical line at x0 lands at x0 -+ 0.3 (y + 1/2) in row y; ShearY likewise for rows."""
    img = np.zeros((20, 30, 3), np.uint8)
    img[:, 15] = 255
    for negate, sign in ((False, -1), (True, 1)):
        out = augment.rand_augment_op(img, "ShearX", 10, negate=negate)
        cols = out[..., 0].argmax(axis=1)
        want = 15 + sign * 0.3 * (np.arange(20) + 0.5)
        assert np.all(np.abs(cols - want) <= 0.5 + 1e-9), cols
    img = np.zeros((30, 20, 3), np.uint8)
    img[15] = 255
    rows = augment.rand_augment_op(img, "ShearY", 10)[..., 0].argmax(axis=0)
    assert np.all(np.abs(rows - (15 - 0.3 * (np.arange(20) + 0.5))) <= 0.5 + 1e-9), rows


def test_rotate_turns_counter_clockwise_about_the_centre():
    """Magnitude 9: 27 degrees. A horizontal line through the centre tilts up to the right
    (+) or down (-); the centre stays, the corners get the fill colour."""
    img = np.zeros((41, 41, 3), np.uint8)
    img[20] = 255
    for negate, sign in ((False, 1), (True, -1)):
        out = augment.rand_augment_op(img, "Rotate", 9, negate=negate)
        for x in range(12, 29):  # columns near the centre (20.5 in pixel-edge coordinates)
            want = 20 - sign * (x - 20) * math.tan(math.radians(27))
            assert abs(int(out[:, x, 0].argmax()) - want) <= 1, (x, want)
        assert np.all(out[0, 0] == FILL) and np.all(out[-1, -1] == FILL)
    flat = np.full((41, 41, 3), 200, np.uint8)
    out = augment.rand_augment_op(flat, "Rotate", 9)
    assert np.all(out[15:26, 15:26] == 200)


def test_rand_augment_rejects_bad_images():
    with pytest.raises(ValueError, match="uint8"):
        augment.rand_augment(np.zeros((4, 4, 3), np.float32), np.random.default_rng(0))
    with pytest.raises(ValueError, match="C 1 or 3"):
        augment.rand_augment(np.zeros((4, 4, 2), np.uint8), np.random.default_rng(0))
    with pytest.raises(ValueError, match="RandAugment op"):
        augment.rand_augment_op(_image(), "Cutout", 5)


# ---------------------------------------------------------------- random erasing
def _check_box(h, w, eh, ew):
    """The box could come from an area fraction in [0.02, 1/3] and an aspect h / w in
    [0.3, 1 / 0.3] before each side was rounded (so each side is within 1/2 of the exact
    one), strictly inside the image."""
    area = h * w
    assert 0 < eh < h and 0 < ew < w
    assert (eh - 0.5) * (ew - 0.5) <= area / 3 and (eh + 0.5) * (ew + 0.5) >= 0.02 * area
    assert (eh - 0.5) / (ew + 0.5) <= 1 / 0.3 and (eh + 0.5) / (ew - 0.5) >= 0.3


def test_random_erasing_one_box_of_bounded_area():
    nan = np.full((60, 80, 3), np.nan, np.float32)  # float: timm's N(0, 1) fill
    fractions = []
    for s in range(30):
        out = augment.random_erasing(nan, np.random.default_rng(s), prob=1.0)
        assert out.shape == nan.shape and out.dtype == np.float32
        erased = np.all(np.isfinite(out), axis=-1)
        assert np.all(np.isfinite(out) == erased[..., None])  # all channels erased together
        rows, cols = np.flatnonzero(erased.any(1)), np.flatnonzero(erased.any(0))
        assert erased.sum() == rows.size * cols.size  # exactly one rectangle
        assert np.all(erased[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1])
        _check_box(60, 80, rows.size, cols.size)
        fractions.append(erased.mean())
    assert 0.02 * 0.8 <= min(fractions) and max(fractions) <= 1.2 / 3
    img = _image((60, 80, 3))
    assert augment.random_erasing(img, np.random.default_rng(0), prob=0.0) is img
    hits = sum(
        not np.array_equal(augment.random_erasing(img, np.random.default_rng(s)), img)
        for s in range(400)
    )
    assert abs(hits / 400 - 0.25) < 5 * math.sqrt(0.25 * 0.75 / 400)  # default prob 0.25
    a = augment.random_erasing(img, np.random.default_rng(7), prob=1.0)
    np.testing.assert_array_equal(a, augment.random_erasing(img, np.random.default_rng(7), prob=1))


def _rounded_clipped_normal_moments(mu, sd):
    """Mean and std of round(clip(mu + sd N(0, 1), 0, 255)), exactly (sum over 0..255)."""
    cdf = [0.5 * (1 + math.erf((k + 0.5 - mu) / (sd * math.sqrt(2)))) for k in range(255)]
    p = np.diff(np.concatenate([[0.0], cdf, [1.0]]))
    k = np.arange(256.0)
    mean = float(p @ k)
    return mean, math.sqrt(float(p @ (k - mean) ** 2))


@pytest.mark.parametrize("channels", [3, 1])
def test_random_erasing_pixel_noise_matches_the_normalisation(channels):
    """uint8: erased pixels are round(clip(mean_c + std_c N(0, 1), 0, 255)) (ImageNet stats
    for C = 3, 127.5 / 127.5 otherwise, as `ViT` normalises). Their sample mean / std are
    within 5 standard errors (sd / sqrt(n), sd / sqrt(2 n)) of that law's exact moments, which
    are within 1 (mean) and 2-5% (std: the tails are clipped) of the channel's mean / std."""
    img = np.ones((120, 120, channels), np.uint8)  # P(noise rounds to 1) < 0.2%
    samples = []
    for s in range(10):
        out = augment.random_erasing(img, np.random.default_rng(s), prob=1.0)
        changed = np.any(out != 1, axis=-1)
        rows, cols = np.flatnonzero(changed.any(1)), np.flatnonzero(changed.any(0))
        box = (slice(rows[0], rows[-1] + 1), slice(cols[0], cols[-1] + 1))
        assert changed.sum() == changed[box].sum() and changed[box].mean() > 0.98
        _check_box(120, 120, rows.size, cols.size)
        samples.append(out[box].reshape(-1, channels).astype(np.float64))
    pixels = np.concatenate(samples)
    n = len(pixels)
    assert n > 10_000
    if channels == 3:
        means, stds = augment.IMAGENET_MEAN, augment.IMAGENET_STD
    else:
        means, stds = (127.5,), (127.5,)
    for c, (mu, sd) in enumerate(zip(means, stds, strict=True)):
        mean, std = _rounded_clipped_normal_moments(mu, sd)
        if channels == 3:
            assert abs(mean - mu) < 1.0 and 0.95 < std / sd < 0.98
        assert abs(pixels[:, c].mean() - mean) <= 5 * std / math.sqrt(n)
        assert abs(pixels[:, c].std() - std) <= 5 * std / math.sqrt(2 * n)


# ---------------------------------------------------------------- the training stream
def _records(shape, n=12):
    rng = np.random.default_rng(0)
    return [
        {"image": rng.integers(0, 256, shape).astype(np.uint8), "label": i % 3} for i in range(n)
    ]


@pytest.mark.parametrize("augment,shape", [("pad_crop", (16, 16, 3)), ("inception", (24, 20, 3))])
def test_image_task_randaugment_erasing_train_only(augment, shape):
    recs = _records(shape)
    splits = {"train": recs, "val": recs[:6]}
    plain = images.ImageTask("toy", splits, 3, (16, 16), augment=augment)
    deit = images.ImageTask(
        "toy", splits, 3, (16, 16), augment=augment, randaugment=(2, 9, 0.5), random_erasing=0.25
    )
    for step in range(2):
        a, b = plain.train_batch(step, 8, seed=1), deit.train_batch(step, 8, seed=1)
        assert b["inputs"].shape == (8, 16, 16, 3) and b["inputs"].dtype == np.uint8
        np.testing.assert_array_equal(a["targets"], b["targets"])  # same shuffle
        differ = [not np.array_equal(x, y) for x, y in zip(a["inputs"], b["inputs"])]
        assert sum(differ) >= 4, differ
        np.testing.assert_array_equal(b["inputs"], deit.train_batch(step, 8, seed=1)["inputs"])
    resumed = next(deit.train_batches(8, seed=1, start_step=1))
    np.testing.assert_array_equal(resumed["inputs"], deit.train_batch(1, 8, seed=1)["inputs"])
    for e, f in zip(plain.eval_batches("val", 4), deit.eval_batches("val", 4), strict=True):
        np.testing.assert_array_equal(e["inputs"], f["inputs"])


def test_config_fields_and_validation(monkeypatch):
    deit, mini = configs.get_config("vit", "deit_tiny"), configs.get_config("vit", "mini")
    assert (deit.data.randaugment, deit.data.random_erasing) == ((2, 9, 0.5), 0.25)
    assert (mini.data.randaugment, mini.data.random_erasing) == (None, 0.0)
    recs = _records((8, 8, 3), n=20)
    monkeypatch.setattr(images, "open_source", lambda name, split, data_dir: recs)
    task = images.build_image_task(
        {"dataset": "cifar10", "randaugment": [1, 5, 0], "random_erasing": 1}
    )
    assert task.randaugment == (1, 5.0, 0.0) and task.random_erasing == 1.0
    task = images.build_image_task({"dataset": "cifar10"})
    assert task.randaugment is None and task.random_erasing == 0.0
    for bad in [(2, 11, 0.5), (0, 9, 0.5), (2, 9, -1), (2, 9), "rand-m9", (2.5, 9, 0.5)]:
        with pytest.raises(ValueError, match="config 'randaugment'"):
            images.build_image_task({"dataset": "cifar10", "randaugment": bad})
    for bad in (1.5, -0.1, True, "0.25"):
        with pytest.raises(ValueError, match="config 'random_erasing'"):
            images.build_image_task({"dataset": "cifar10", "random_erasing": bad})
    with pytest.raises(ValueError, match="random_erasing"):
        images.ImageTask("toy", {"train": recs}, 3, (8, 8), random_erasing=2.0)
    with pytest.raises(ValueError, match="randaugment"):
        images.ImageTask("toy", {"train": recs}, 3, (8, 8), randaugment=(2, float("inf"), 0.5))
