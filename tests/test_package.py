"""What a user installs: the wheel holds every config and the bundled envs, declares the commands, and checks a config
from a directory outside the checkout with nothing of the checkout on its path."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_the_wheel_holds_every_config_and_checks_one_outside_the_checkout(tmp_path):
    source = tmp_path / "source"  # a copy: setuptools builds in the source tree, and the checkout stays as it is
    skipped = shutil.ignore_patterns(".git", ".venv*", "build", "outputs", "multirun", "*.egg-info", "__pycache__")
    shutil.copytree(ROOT, source, ignore=skipped)
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            tmp_path / "dist",
            source,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("primerl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {str(p.relative_to(ROOT)) for p in (ROOT / "primerl" / "conf").rglob("*.yaml")}
    assert len(configs) > 20 and configs <= names, sorted(configs - names)
    for package in ("primerl_chat", "primerl_reverse_text", "primerl_guess_number", "primerl_long_tail"):
        assert f"{package}/__init__.py" in names
    entry_points = zipfile.ZipFile(wheel).read("primerl-0.1.0.dist-info/entry_points.txt").decode()
    assert "primerl = primerl.cli:main" in entry_points
    metadata = zipfile.ZipFile(wheel).read("primerl-0.1.0.dist-info/METADATA").decode()
    assert "Apache-2.0" in metadata and any(name.endswith("/LICENSE") for name in names)

    site, outside = tmp_path / "site", tmp_path / "elsewhere"
    outside.mkdir()
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(site)}  # ahead of the checkout's editable install

    def primerl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, site / "bin" / "primerl", *args],
            cwd=outside,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import primerl, primerl_reverse_text; print(primerl.__file__, primerl_reverse_text.__file__)",
        ],
        cwd=outside,
        env=env,
        capture_output=True,
        text=True,
    )
    assert all(Path(p).is_relative_to(site) for p in where.stdout.split()), where.stdout + where.stderr
    shown = primerl("train", "+experiment=reverse_text", "--cfg", "job")
    assert shown.returncode == 0 and "name: reverse_text" in shown.stdout, shown.stderr[-2000:]
    bad = primerl("train", "+experiment=reverse_text", "trainer.optim.lrr=1")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("primerl: config error: trainer.optim.lrr"), bad.stderr
    assert "train" in primerl("--help").stdout and not list(outside.iterdir())  # nothing written where it ran
