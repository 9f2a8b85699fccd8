"""The examples that need no model run as their docstrings say, and leave nothing behind."""
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"


@pytest.mark.parametrize("name,says", [
    ("cxl_pool.py", "near-memory selection: same chunks as shadowkv: True"),
    ("tier_manager.py", "block 3 reads back as 3"),
    ("tune_my_policy.py", "(--out FILE writes it for tierkv run --config FILE)"),
])
def test_an_example_runs_and_leaves_nothing(name, says, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp_path),
           "PYTHONPATH": str(EXAMPLES.parent)}
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert says in done.stdout
    assert not [p for p in tmp_path.iterdir() if p.name != ".cache"]
