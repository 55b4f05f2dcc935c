"""`train.bench.official`: the side-by-side harness of our LARA and the official PyTorch code.
The official code and torch are not dependencies of the project, so what runs here is the
harness itself: its errors, the alternation of calls, and the equal-cores default."""

import importlib.util

import pytest

from train.bench import official
from train.bench.__main__ import build_parser


def test_a_path_that_is_not_the_official_checkout_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="abstract_attention.py not found"):
        official.load_linear_ra(str(tmp_path))


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed")
def test_without_torch_the_error_says_what_to_install(tmp_path):
    pkg = tmp_path / "efficient-attention" / "efficient_attention"
    pkg.mkdir(parents=True)
    for name in ("abstract_attention", "attn_utils", "lara"):
        (pkg / f"{name}.py").write_text("")
    with pytest.raises(ImportError, match="pip install torch"):
        official.load_linear_ra(str(tmp_path))


def test_calls_alternate_and_each_side_reports_its_minimum():
    calls = []
    ms_a, ms_b = official.interleaved_min(lambda: calls.append("a"), lambda: calls.append("b"), 3)
    assert "".join(calls) == "ab" * 5  # two warm-ups each, then 3 timed pairs
    assert 0.0 <= ms_a < 1e3 and 0.0 <= ms_b < 1e3


def test_torch_gets_the_cores_xla_uses_unless_told():
    args = build_parser().parse_args(["official", "--repo", "x"])
    assert args.threads is None and official.cpu_cores() >= 1
    assert args.seq_lens == [1024, 4096, 16384]
