"""``scripts/test --quick`` collects only the files it names: every test marked ``quick``
must be in one of them, or the smoke subset would silently leave it out. Read from the
sources (collecting every test module is what ``--quick`` avoids)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def quick_files_of_the_script() -> set[str]:
    script = (REPO / "scripts" / "test").read_text()
    block = script[script.index('"--quick"') :].split("\nfi", 1)[0]
    words = shlex.split(block.replace("\\\n", " "), comments=True)
    return {w for w in words if w.startswith("tests/") and w.endswith(".py")}


def files_with_quick_tests() -> set[str]:
    marked = re.compile(r"pytest\.mark\.quick\b")
    return {
        str(path.relative_to(REPO))
        for path in (REPO / "tests").rglob("test_*.py")
        if path.name != "test_quick_subset.py" and marked.search(path.read_text())
    }


def test_every_quick_test_is_in_a_file_scripts_test_quick_collects() -> None:
    named = quick_files_of_the_script()
    assert len(named) >= 4 and all((REPO / f).is_file() for f in named)
    assert files_with_quick_tests() == named
