"""The wheel ships the product (``storaged``, ``tiers``, ``erasure``) and nothing else: the
load tests and the tests run from a checkout. Built for real, as a user's pip would."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_wheel_ships_the_product_packages_only(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), str(REPO)],
        check=True, capture_output=True, timeout=240,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("storaged-*.whl")
    with zipfile.ZipFile(wheel) as z:
        tops = {name.split("/", 1)[0] for name in z.namelist()}
        names = set(z.namelist())
    packages = {t for t in tops if not t.endswith(".dist-info")}
    assert packages == {"storaged", "tiers", "erasure"}, packages
    # the console script's module and the type marker are in it
    assert {"storaged/cli.py", "storaged/py.typed", "tiers/base.py", "erasure/base.py"} <= names
