"""Files that readers never see half-written (atomic rename), and their sha256."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path beside `path`; rename it over `path` only on success."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def atomic_folder(path):
    """Yield a new temporary folder beside `path`; on success it replaces `path`, on failure
    it is deleted and `path` is untouched. An older folder of that name is first renamed
    aside, the new one renamed in, and only then the old one removed: at every instant one
    complete folder exists under its own or an aside name (`.NAME.old-*`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    aside = None
    try:
        yield tmp
        if path.exists():
            aside = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, aside)
        os.replace(tmp, path)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def write_json_atomic(path, data) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def sha256_file(path, block: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in `block`-byte pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()
