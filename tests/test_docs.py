"""Every Python block of the README and docs/ runs as written, in a fresh process (CPU)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = [(path.relative_to(ROOT).as_posix(), i, code)
          for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S))]


def test_the_readme_has_code_blocks():
    assert sum(name == "README.md" for name, _, _ in BLOCKS) >= 3


@pytest.mark.parametrize("name,index,code", BLOCKS, ids=[f"{n}-{i}" for n, i, _ in BLOCKS])
def test_code_block_runs(name, index, code):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, f"{name} block {index} failed:\n{done.stderr[-2000:]}"
