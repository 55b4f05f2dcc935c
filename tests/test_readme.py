"""The README's Python examples run as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2
    namespace = {}
    for block in blocks:  # later blocks use names from earlier ones, as a reader would
        exec(compile(block, str(README), "exec"), namespace)
    assert namespace["out"].shape == (2, 128, 4, 32)
    assert namespace["y"].shape == (2, 16, 64)
