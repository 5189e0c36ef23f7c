"""A cache of what is costly to derive from a checkpoint file: its config, its tokenizer and its
dequantised weights, under `$XDG_CACHE_HOME/braid` (default `~/.cache/braid`).

An entry is a folder named by a key of the source file's identity (path, size, mtime and a hash
of its first MiB), braid's version, the kind of entry and its variant (a dtype). A changed source
or a new braid version therefore looks up a different entry; a stale one is never read. An entry
is built in a temporary folder and renamed into place, so concurrent launches never see half an
entry (the loser of a race discards its copy). Its `manifest.json`, written last, records every
file's size: a truncated file is detected, and an entry that fails to load is rebuilt with a
warning, never a crash.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
MANIFEST = "manifest.json"
_HEADER_BYTES = 1 << 20


class CacheWarning(UserWarning):
    """A cache entry was unusable (rebuilt) or could not be written (the source is used)."""


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/braid`, or `~/.cache/braid` when the variable is unset or empty."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "braid"


# The modules whose code decides what an entry holds: an edit to one (an editable install
# keeps its version number) must not read entries its previous code wrote. Glob patterns allowed;
# `models/*.py`: each family module's spec says how a GGUF file of the family is read.
_DERIVING_MODULES = ("cache.py", "config.py", "loader/gguf.py", "loader/gguf_families.py",
                     "loader/model_config.py", "loader/weights.py", "loader/weight_cache.py",
                     "loader/tokenizer.py", "models/*.py")


def braid_version() -> str:
    """braid's package version and a hash of the modules that derive cache entries."""
    try:
        release = version("braid-llm")
    except PackageNotFoundError:  # running from a source tree that is not installed
        release = "unknown"
    package = Path(__file__).parent
    # (a name that matches no file is read as itself, and fails: a renamed module is noticed)
    files = [f for m in _DERIVING_MODULES for f in sorted(package.glob(m)) or [package / m]]
    code = hashlib.sha256(b"".join(f.read_bytes() for f in files))
    return f"{release}+{code.hexdigest()[:12]}"


def code_version() -> str:
    """braid's package version and a hash of all its code (Python and C++): compiled graphs,
    which any of it may shape, are keyed by this."""
    package = Path(__file__).parent
    files = sorted(p for p in package.rglob("*") if p.suffix in (".py", ".cpp", ".h"))
    code = hashlib.sha256(b"".join(p.read_bytes() for p in files))
    return f"{braid_version()}+{code.hexdigest()[:12]}"


def model_identity(path: str | Path) -> list:
    """Path, size and modification time of a model file, or of every file in a model folder:
    what keys the entries that a model's weights shape (compiled graphs, step times)."""
    path = Path(path).resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def replace_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` into a temporary sibling of `path`, then renamed over it: concurrent ranks
    and launches never read half a file. A failed write removes the temporary and raises."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def entry_key(source: str | Path, kind: str, variant: str = "") -> str:
    """Key of `source`'s `kind` entry: changes with the file, its header, braid's version."""
    path = Path(source).resolve()
    stat = path.stat()
    with open(path, "rb") as f:
        header = hashlib.sha256(f.read(_HEADER_BYTES)).hexdigest()
    identity = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                "header_sha256": header, "braid": braid_version(), "kind": kind,
                "variant": variant}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


def _entry_prefix(kind: str, variant: str) -> str:
    """The start of the folder names of `kind` entries (the key follows)."""
    return f"{kind}-{variant}-" if variant else f"{kind}-"


def entry_dir(source: str | Path, kind: str, variant: str = "") -> Path:
    """Where `source`'s `kind` entry lives (whether or not it exists)."""
    return cache_root() / (_entry_prefix(kind, variant) + entry_key(source, kind, variant))


def check_entry(folder: Path) -> None:
    """Raise `ValueError` unless `folder` is a complete entry (manifest present, sizes match)."""
    manifest_file = folder / MANIFEST
    if not manifest_file.is_file():
        raise ValueError("no manifest (an incomplete entry)")
    for name, size in json.loads(manifest_file.read_text())["files"].items():
        file = folder / name
        if not file.is_file():
            raise ValueError(f"{name} is missing")
        if file.stat().st_size != size:
            raise ValueError(f"{name} has {file.stat().st_size} bytes, expected {size}")


def find_entry(source: str | Path, kind: str, variant: str = "") -> Path | None:
    """The complete entry for `source`, or None (read-only: never builds or deletes)."""
    folder = entry_dir(source, kind, variant)
    try:
        check_entry(folder)
    except (ValueError, OSError):
        return None
    return folder


def _remove_stale(folder: Path, prefix: str, source: Path) -> None:
    """Delete the entries named `prefix*` built from an earlier version of `source` (a process
    still reading one keeps its open files: removal only unlinks them)."""
    for other in folder.parent.glob(prefix + "*"):
        try:
            stale = json.loads((other / MANIFEST).read_text())["source"] == str(source)
        except (OSError, ValueError, KeyError):
            continue
        if other != folder and stale:
            shutil.rmtree(other, ignore_errors=True)


def _build(folder: Path, prefix: str, source: str | Path,
           build: Callable[[Path], None]) -> None:
    """Run `build` into a temporary sibling of `folder`, write its manifest, rename it."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        build(tmp)
        files = {str(p.relative_to(tmp)): p.stat().st_size
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {"source": str(Path(source).resolve()), "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        try:
            os.rename(tmp, folder)
        except OSError:
            if not folder.exists():
                raise
            # Another launch built the same entry first: keep theirs.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _remove_stale(folder, prefix, Path(source).resolve())


def cached(source: str | Path, kind: str, build: Callable[[Path], None],
           load: Callable[[Path], T], variant: str = "") -> T | None:
    """`load(entry)` of `source`'s `kind` entry, building it with `build(folder)` when missing.

    An entry that is incomplete or fails to load is rebuilt with a `CacheWarning`. Returns None
    (with a warning) when the cache cannot be written, so the caller derives from the source.
    """
    folder = entry_dir(source, kind, variant)
    if folder.exists():
        try:
            check_entry(folder)
            return load(folder)
        except Exception as e:  # noqa: BLE001 - any damage to an entry means: rebuild it
            warnings.warn(f"cache entry {folder} is unusable ({e}); rebuilding it",
                          CacheWarning, stacklevel=2)
            shutil.rmtree(folder, ignore_errors=True)
    try:
        _build(folder, _entry_prefix(kind, variant), source, build)
    except OSError as e:
        warnings.warn(f"cannot write the cache under {cache_root()} ({e}); "
                      f"reading {source} directly", CacheWarning, stacklevel=2)
        return None
    return load(folder)
