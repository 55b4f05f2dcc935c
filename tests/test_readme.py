"""The README's and the docs pages' Python examples run as written.

Every block fenced exactly as ```python runs; a page's blocks share one namespace, in order,
as a reader would run them (the README's too). Measurement scripts that take minutes are
fenced ```py on the pages and are not run here (each named beside the numbers it produced).
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))


def python_blocks(path):
    # A fence may be indented (inside a list item); the block is dedented by its fence's indent.
    blocks = []
    for indent, body in re.findall(r"^( *)```python\n(.*?)^\1```", path.read_text(), re.S | re.M):
        lines = body.splitlines(keepends=True)
        blocks.append("".join(line[len(indent) :] for line in lines))
    return blocks


def run_blocks(path):
    namespace = {}
    for block in python_blocks(path):
        exec(compile(block, str(path), "exec"), namespace)
    return namespace


def test_readme_python_blocks_run():
    assert len(python_blocks(README)) >= 2
    namespace = run_blocks(README)
    assert namespace["out"].shape == (2, 128, 4, 32)
    assert namespace["y"].shape == (2, 16, 64)


def test_readme_test_command_is_the_ci_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -n 2\n" in ci
    assert re.search(r"^python -m pytest -n 2 ", README.read_text(), re.M)


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in PAGES])
def test_docs_python_blocks_run(page):
    path = ROOT / page
    if not python_blocks(path):
        pytest.skip(f"{page} has no ```python block")
    run_blocks(path)


def test_docs_pages_with_examples_are_run():
    with_blocks = {p.name for p in PAGES if python_blocks(p)}
    for name in ("getting-started.md", "api-contract.md", "integration.md", "long-sequences.md"):
        assert name in with_blocks, name
