"""The wheel installs: built from this tree, installed into a fresh virtual environment beside
the same torch (and the other dependencies, not reinstalled), it carries the C++ sources its
operators are built from, and its `braid` serves `--help` and generates."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from braid import native

ROOT = Path(__file__).resolve().parents[1]


def run(argv: list, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{argv}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: setuptools is in this environment, and nothing is downloaded
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--wheel-dir", out, ROOT], timeout=300)
    (found,) = out.glob("braid_llm-*.whl")
    return found


@pytest.fixture(scope="module")
def fresh_env(wheel, tmp_path_factory) -> Path:
    """A new virtual environment holding only the wheel; this environment's packages (torch,
    the embedded model, ...) are reachable after its own, as a dependency resolver would
    have installed them."""
    env = tmp_path_factory.mktemp("env") / "venv"
    run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", env],
        timeout=120)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": env, "platbase": env}))
    (purelib / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    run([sys.executable, "-m", "pip", "--python", env / "bin" / "python", "install", "--no-deps",
         "--no-index", wheel], timeout=300)
    return env


def test_the_wheel_carries_the_operator_sources_and_every_package(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "braid" / "csrc").iterdir()}
    assert sources and sources <= names, sorted(sources - names)
    packages = {p.parent.relative_to(ROOT).as_posix()
                for p in (ROOT / "braid").rglob("*.py")}
    assert {f"{package}/__init__.py" for package in packages} <= names


@pytest.mark.slow  # builds the operators again; make test checks the wheel's contents
def test_the_installed_wheel_builds_its_operators_and_generates(fresh_env, model_path):
    python, braid = fresh_env / "bin" / "python", fresh_env / "bin" / "braid"
    env = {**os.environ, "PATH": f"{fresh_env / 'bin'}:{os.environ['PATH']}"}
    away = {"env": env, "cwd": fresh_env}  # not this tree: `python -c` imports from its cwd
    # The installed package's sources key the operators' build: the same folder as this
    # tree's (the session built it) where they are the same files.
    where = run([python, "-c", "from braid import native; assert native.load(); "
                 "print(native.CSRC); print(native.build_dir())"], **away, timeout=300)
    csrc, build = where.stdout.split()
    assert Path(csrc).is_relative_to(fresh_env), csrc
    assert build == str(native.build_dir())
    assert "--api-key" in run([braid, "serve", "--help"], **away, timeout=60).stdout
    out = run([braid, "generate", "--model", model_path, "--max-new-tokens", "3",
               "--temperature", "0", "--compile", "off", "Hello"], **away, timeout=300)
    assert out.stdout.strip()
