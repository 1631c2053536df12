"""The README's Python example runs as written (it is the first thing a user copies)."""

import re
from pathlib import Path

import pytest

pytest.importorskip("numpy")


def test_the_readme_example_runs():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert blocks, "the README has a Python example"
    scope = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    assert [int(c[0]) for c in scope["chunks"]] == [0, 1]
