"""The linter's verdict is part of the suite: `ruff check` with the configuration in pyproject.toml
([tool.ruff]: pycodestyle E/W and pyflakes F at line length 160) over the whole tree."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", str(ROOT)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_reads_our_configuration(tmp_path):
    """A check on the check: a file with an unused import and a 161-character line fails it."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n" + "x = " + "1 + " * 39 + "1\n")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"),
                          "--output-format", "concise", str(bad)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "F401" in out.stdout and "E501" in out.stdout, out.stdout + out.stderr
