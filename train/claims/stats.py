"""The verdict of a comparison, from a 95% interval of the difference (`Rule`, `decide`).

A claim that compares two things over seeds (accuracies, errors) states its `Rule` before
its numbers: which side must win, the interval (Welch's t over seeds with the sample std,
ddof = 1; a paired t when the seeds are matched; or a percentile bootstrap) and the smallest
difference that counts (`margin`). The verdict follows from the interval alone:

* ``"greater"`` (a > b) / ``"less"`` (a < b): **reproduced** when the whole interval is on
  the claimed side of 0; **not reproduced** when it excludes a win of `margin` or more
  (the interval's far end is below `margin` in the claimed direction); **inconclusive**
  otherwise (the data allow both a win of `margin` and none at all).
* ``"equivalent"`` (a about as b): **reproduced** when the interval is inside
  ``(-margin, margin)``; **not reproduced** when it lies wholly outside; **inconclusive**
  otherwise.

Several comparisons (tasks, baselines) combine with `combine`: all reproduced ->
reproduced, all not reproduced -> not reproduced, some reproduced -> partly, otherwise
inconclusive; comparisons that are not testable (e.g. softmax did not learn the task)
are left out, and none left -> not testable here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

REPRODUCED, PARTLY, NOT_REPRODUCED, INCONCLUSIVE, NOT_TESTABLE = (
    "reproduced",
    "partly",
    "not reproduced",
    "inconclusive",
    "not testable here",
)
VERDICTS = (REPRODUCED, PARTLY, NOT_REPRODUCED, INCONCLUSIVE, NOT_TESTABLE)
DIRECTIONS = ("greater", "less", "equivalent")
TESTS = ("welch", "paired", "bootstrap")
LEVEL = 0.95
BOOTSTRAP_RESAMPLES = 10_000


def _t_quantile(df: float) -> float:
    from scipy import stats

    return float(stats.t.ppf(0.5 + LEVEL / 2, df))


def interval(a: Sequence[float], b: Sequence[float], test: str = "welch", seed: int = 0):
    """``(diff, lo, hi)``: mean(a) - mean(b) and its 95% interval by `test`.

    ``"welch"``: Welch's t (sample variances, ddof = 1; Welch-Satterthwaite df);
    ``"paired"``: t over the per-seed differences ``a_i - b_i`` (equal lengths);
    ``"bootstrap"``: percentile bootstrap, each group resampled (`BOOTSTRAP_RESAMPLES`,
    fixed `seed`).

    Raises:
      ValueError: an unknown `test`, fewer than 2 values on a side, or unequal lengths
        for ``"paired"``.
    """
    a, b = np.asarray(list(a), np.float64), np.asarray(list(b), np.float64)
    if test not in TESTS:
        raise ValueError(f"interval: test must be one of {TESTS}, got {test!r}")
    if a.size < 2 or b.size < 2:
        raise ValueError(f"interval: need >= 2 values per side, got {a.size} and {b.size}")
    diff = float(a.mean() - b.mean())
    if test == "paired":
        if a.size != b.size:
            raise ValueError(f"interval: paired needs equal lengths, got {a.size}, {b.size}")
        d = a - b
        half = _t_quantile(d.size - 1) * d.std(ddof=1) / math.sqrt(d.size)
        return diff, diff - half, diff + half
    if test == "bootstrap":
        rng = np.random.default_rng(seed)
        ia = rng.integers(0, a.size, (BOOTSTRAP_RESAMPLES, a.size))
        ib = rng.integers(0, b.size, (BOOTSTRAP_RESAMPLES, b.size))
        boot = a[ia].mean(1) - b[ib].mean(1)
        lo, hi = np.percentile(boot, [50 * (1 - LEVEL), 50 * (1 + LEVEL)])
        return diff, float(lo), float(hi)
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    se = math.sqrt(va + vb)
    if se == 0.0:
        return diff, diff, diff
    df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))
    half = _t_quantile(df) * se
    return diff, diff - half, diff + half


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one comparison ``a`` vs ``b`` is decided (see the module docstring).

    Attributes:
      direction: ``"greater"`` (a > b), ``"less"`` (a < b) or ``"equivalent"``.
      margin: the smallest difference that counts, in the units of the values (>= 0).
      test: ``"welch"``, ``"paired"`` or ``"bootstrap"`` (`interval`).
      unit: how the values are printed: ``"points"`` (accuracies in [0, 1], shown x 100)
        or a plain unit name.
    """

    direction: str
    margin: float = 0.0
    test: str = "welch"
    unit: str = "points"

    def __post_init__(self):
        if self.direction not in DIRECTIONS:
            raise ValueError(f"Rule: direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if self.test not in TESTS:
            raise ValueError(f"Rule: test must be one of {TESTS}, got {self.test!r}")
        if not self.margin >= 0:
            raise ValueError(f"Rule: margin must be >= 0, got {self.margin!r}")
        if self.direction == "equivalent" and self.margin == 0:
            raise ValueError("Rule: an 'equivalent' rule needs a margin > 0")

    def show(self, x: float) -> str:
        return f"{100 * x:+.1f}" if self.unit == "points" else f"{x:+.3g}"

    def text(self, a: str = "a", b: str = "b") -> str:
        """The rule in words (printed beside the claim, before its numbers)."""
        how = {
            "welch": "Welch's t over seeds, sample std (ddof = 1)",
            "paired": "paired t over matched seeds, sample std (ddof = 1)",
            "bootstrap": f"percentile bootstrap ({BOOTSTRAP_RESAMPLES} resamples)",
        }[self.test]
        m = self.show(self.margin).lstrip("+")
        unit = " points" if self.unit == "points" else f" {self.unit}"
        d = f"{a} - {b}"
        if self.direction == "equivalent":
            body = (
                f"reproduced when the 95% interval of {d} ({how}) lies inside +-{m}{unit}; "
                f"not reproduced when it lies wholly outside; inconclusive otherwise."
            )
        else:
            side, sign = (">", "") if self.direction == "greater" else ("<", "-")
            body = (
                f"reproduced when the 95% interval of {d} ({how}) is wholly {side} 0; "
                f"not reproduced when it excludes a difference of {sign}{m}{unit} or beyond "
                f"in the claimed direction; inconclusive otherwise."
            )
        return body

    def decide(self, a: Sequence[float], b: Sequence[float]) -> tuple[str, dict]:
        """``(verdict, stats)``: the verdict of a vs b and ``{"diff", "lo", "hi", "n"}``.
        Fewer than 2 values on a side: inconclusive (no interval)."""
        a, b = list(a), list(b)
        if len(a) < 2 or len(b) < 2:
            return INCONCLUSIVE, {"diff": None, "lo": None, "hi": None, "n": (len(a), len(b))}
        diff, lo, hi = interval(a, b, self.test)
        out = {"diff": diff, "lo": lo, "hi": hi, "n": (len(a), len(b))}
        return decide(self.direction, lo, hi, self.margin), out

    def summary(self, stats: dict) -> str:
        """``"+2.1 [+0.4, +3.8]"`` (the difference and its interval), or ``"no interval"``."""
        if stats.get("diff") is None:
            return f"no interval ({stats['n'][0]} and {stats['n'][1]} values)"
        return f"{self.show(stats['diff'])} [{self.show(stats['lo'])}, {self.show(stats['hi'])}]"


def decide(direction: str, lo: float, hi: float, margin: float = 0.0) -> str:
    """The verdict of a claimed `direction` from the 95% interval ``[lo, hi]`` of a - b."""
    if direction not in DIRECTIONS:
        raise ValueError(f"decide: direction must be one of {DIRECTIONS}, got {direction!r}")
    if not lo <= hi:
        raise ValueError(f"decide: need lo <= hi, got [{lo}, {hi}]")
    if direction == "less":
        lo, hi = -hi, -lo
    if direction == "equivalent":
        if -margin < lo and hi < margin:
            return REPRODUCED
        if lo >= margin or hi <= -margin:
            return NOT_REPRODUCED
        return INCONCLUSIVE
    if lo > 0:
        return REPRODUCED
    if hi < margin:
        return NOT_REPRODUCED
    return INCONCLUSIVE


def combine(verdicts: Iterable[str]) -> str:
    """One verdict from several comparisons (see the module docstring)."""
    vs = [v for v in verdicts if v != NOT_TESTABLE]
    bad = [v for v in vs if v not in VERDICTS]
    if bad:
        raise ValueError(f"combine: verdicts must be in {VERDICTS}, got {bad}")
    if not vs:
        return NOT_TESTABLE
    if all(v == REPRODUCED for v in vs):
        return REPRODUCED
    if all(v == NOT_REPRODUCED for v in vs):
        return NOT_REPRODUCED
    if any(v in (REPRODUCED, PARTLY) for v in vs):
        return PARTLY
    return INCONCLUSIVE
