"""The Pathfinder generator's parameters (`train.data.snakes` draws the images): the
`PathfinderSpec` dataclass, LRA's difficulty splits and the ``full`` / ``pathx`` / ``mini``
presets. Plain data, so `train.configs.pathfinder` can read the fields without importing
the generator."""

from __future__ import annotations

import dataclasses

SPLITS = ("train", "val", "test")
DIFFICULTY_LENGTHS = {"easy": 6, "intermediate": 9, "hard": 14}


@dataclasses.dataclass(frozen=True)
class PathfinderSpec:
    """Generation parameters (defaults: LRA pathfinder32 hard, full size)."""

    image_size: int = 32
    contour_length: int = 14  # paddles per main contour (the difficulty knob)
    distractor_length: int = 4  # paddles per distractor (LRA: contour_length // 3)
    num_distractors: int = 5  # LRA: 20 // distractor_length
    paddle_length: float = 2.0  # px
    paddle_thickness: float = 1.5  # px (Linsley's default; LRA's value is not published)
    margin: float = 1.0  # px; consecutive paddles are ~2 * margin apart
    seed_distance: float = 7.0  # px between the origins of the two main contours
    continuity: float = 1.0  # turn weight cos(min(continuity * turn, pi / 2)) ** 2
    snake_contrast: float = 1.0  # distractors; Linsley repeats this list x 2 (one per main)
    paddle_contrast: float = 0.75  # main contours: snake_contrast * paddle_contrast
    marker_radius: float = 1.5
    num_train: int = 160_000  # LRA: 80/10/10 of 200k images
    num_val: int = 20_000
    num_test: int = 20_000
    seed: int = 0
    tries: int = 8  # attempts per distractor before it is left out

    def __post_init__(self):
        if self.image_size < 8:
            raise ValueError(f"image_size must be >= 8, got {self.image_size}")
        if self.contour_length < 1 or self.distractor_length < 1 or self.num_distractors < 0:
            raise ValueError(
                "contour_length and distractor_length must be >= 1 and num_distractors >= 0, "
                f"got {self.contour_length}, {self.distractor_length}, {self.num_distractors}"
            )
        for name in ("paddle_length", "paddle_thickness", "seed_distance", "continuity"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.margin < 0 or self.marker_radius <= 0:
            raise ValueError(
                f"need margin >= 0 and marker_radius > 0, got {self.margin}, {self.marker_radius}"
            )
        if 2 * self.seed_distance + 2 > self.image_size:
            raise ValueError(
                f"seed_distance {self.seed_distance} does not fit in image_size "
                f"{self.image_size} (need 2 * seed_distance + 2 <= image_size)"
            )
        for name in ("num_train", "num_val", "num_test"):
            if getattr(self, name) % 2:
                raise ValueError(f"{name} must be even (balanced), got {getattr(self, name)}")

    def cache_name(self) -> str:
        return (
            f"snakes2_s{self.image_size}_len{self.contour_length}_d{self.num_distractors}x"
            f"{self.distractor_length}_p{self.paddle_length:g}x{self.paddle_thickness:g}"
            f"m{self.margin:g}_sd{self.seed_distance:g}_c{self.continuity:g}"
            f"_k{self.snake_contrast:g}x{self.paddle_contrast:g}_r{self.marker_radius:g}"
            f"_t{self.tries}_n{self.num_train}-{self.num_val}-{self.num_test}_seed{self.seed}"
        )

    @property
    def separation(self) -> float:
        """Smallest distance between the centre lines of paddles of different contours
        (Linsley: a paddle's mask is its body dilated by ``margin``; masks may not overlap)."""
        return self.paddle_thickness + 2 * self.margin

    @property
    def marker_separation(self) -> float:
        """Smallest distance between a contour tip (where a marker may go) and the centre
        line of a paddle of another contour: ``separation`` plus what the marker disk adds."""
        return self.separation + max(self.marker_radius - self.paddle_thickness / 2, 0.0)


def difficulty_spec(difficulty: str, **overrides) -> PathfinderSpec:
    """LRA's pathfinder32 split: contour length 6/9/14, distractors of length // 3, 20 // that."""
    if difficulty not in DIFFICULTY_LENGTHS:
        options = tuple(DIFFICULTY_LENGTHS)
        raise ValueError(f"difficulty must be one of {options}, got {difficulty!r}")
    length = DIFFICULTY_LENGTHS[difficulty]
    fields = dict(
        contour_length=length, distractor_length=length // 3, num_distractors=20 // (length // 3)
    )
    return dataclasses.replace(FULL, **{**fields, **overrides})


FULL = PathfinderSpec()
PATHX = PathfinderSpec(
    image_size=128, paddle_length=5.0, margin=2.0, seed_distance=20.0, marker_radius=3.0
)
# MINI: the easiest setting we found where no cheap feature predicts the label, for a
# 2-core CPU: 12 x 12 images (144 pixels), main contours of 3 paddles with origins 4 px
# apart, no distractors (12 x 12 has room for about 0.3 of one). Measured by `python -m
# train.data.pathfinder --variant mini`, 2000 images: label visible in 100%, marker
# distance AUC 0.475, ink AUC 0.494. Contours of 2 paddles make the marker distance predict
# the label (AUC 0.13-0.25 at 10-12 px); 16 x 16 with 4-paddle contours and one distractor
# (the previous MINI) is also balanced but larger. 40000 training images (cheap to draw):
# with 8000 the mini model (train.configs.pathfinder) overfits before it generalises.
MINI = PathfinderSpec(
    image_size=12,
    contour_length=3,
    distractor_length=1,
    num_distractors=0,
    paddle_length=2.0,
    margin=1.0,
    seed_distance=4.0,
    num_train=40_000,
    num_val=1_000,
    num_test=1_000,
)
