"""Converted graphs kept on disk between processes, for every graph runtime (OpenVINO, ONNX
Runtime): `$PACKED_TRANSFORMERS_CACHE/<runtime>/<key>/` (default
`$XDG_CACHE_HOME` or `~/.cache`, `/packed-transformers`; an empty value turns the cache off).

    path = cached_file("onnxruntime", key, "model.onnx")     # an entry's file, or None
    keep("onnxruntime", key, lambda folder: write(folder))    # written aside, renamed into place

The cache degrades and never fails a run: a cache that cannot be made, read or written (the
variable naming a regular file, a read-only mount, a full disk, a library raising its own
error type while it saves) costs one warning line and the run goes on without it. An entry
appears by atomic rename of a folder written beside it (`.KEY.tmp-PID-*`); whatever a write
leaves is removed at once, and temporaries of processes no longer running are removed by the
next process that writes there (a kill -9 mid-write leaves nothing for long).

Standard library only (torch is imported by `model_digest`, for a torch model, alone): the
torch-free process reads this module too.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from packed_transformers.common.files import process_running

log = logging.getLogger(__name__)

CACHE_VARIABLE = "PACKED_TRANSFORMERS_CACHE"
# a temporary entry: `.KEY.tmp-PID-random`, PID the process writing it
_TEMPORARY = re.compile(r"^\..+\.tmp-(?P<pid>\d+)-\w+$")
_warned: set[str] = set()  # one warning line per cache and process


def cache_base() -> Path | None:
    """$PACKED_TRANSFORMERS_CACHE (empty: no cache), else $XDG_CACHE_HOME or ~/.cache,
    /packed-transformers."""
    chosen = os.environ.get(CACHE_VARIABLE)
    if chosen == "":
        return None
    if chosen:
        return Path(chosen)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "packed-transformers"


def cache_root(runtime: str) -> Path | None:
    """The folder one runtime's entries live in (None: the cache is off)."""
    base = cache_base()
    return None if base is None else base / runtime


def warn_once(root: Path | None, what: str, err: BaseException) -> None:
    """The one warning line a cache problem costs (once per cache and process, whichever of
    its folders met it first)."""
    if str(cache_base()) in _warned:
        return
    _warned.add(str(cache_base()))
    reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    log.warning("graph cache %s: %s (%s); running without it", root, what, reason)


def cached_file(runtime: str, key: str, name: str) -> Path | None:
    """The file `name` of the entry `key`, or None (absent, the cache off or unreadable)."""
    root = cache_root(runtime)
    if root is None:
        return None
    try:
        path = root / key / name
        return path if path.is_file() else None
    except OSError as err:  # e.g. the variable names a file: root/key is "not a directory"
        warn_once(root, "cannot be read", err)
        return None


def discard(runtime: str, key: str) -> None:
    """Remove an entry found damaged (it is built again); a failure to remove is ignored."""
    root = cache_root(runtime)
    if root is not None:
        shutil.rmtree(root / key, ignore_errors=True)


def keep(runtime: str, key: str, write: Callable[[Path], None]) -> bool:
    """Write an entry: `write(folder)` fills a new temporary folder beside the entry, which
    is then renamed to `key` (an entry another process renamed in first is kept, and this one
    removed). -> whether the entry is now there. Any failure, of the file system or of
    `write` (a library's own error type on a full disk), is one warning line; nothing of the
    attempt is left behind."""
    root = cache_root(runtime)
    if root is None:
        return False
    scratch = None
    try:
        if (root / key).is_dir():
            return True
        root.mkdir(parents=True, exist_ok=True)
        remove_dead_temporaries(root)
        scratch = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-{os.getpid()}-", dir=root))
        write(scratch)
        try:
            scratch.rename(root / key)
            scratch = None
        except OSError:
            if not (root / key).is_dir():  # not a race lost: a real failure
                raise
        return True
    except Exception as err:  # noqa: BLE001 - any writer's failure degrades to no cache
        warn_once(root, "cannot be written", err)
        return False
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def remove_dead_temporaries(root: Path) -> list[Path]:
    """Remove the temporary entries under `root` whose writing process is no longer running.
    -> what was removed."""
    removed = []
    for entry in root.iterdir():
        match = _TEMPORARY.match(entry.name)
        if match is None or process_running(int(match.group("pid"))):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def writable_folder(path: Path) -> bool:
    """Whether `path` is (or can be made) a folder this process can write a file in: asked
    before a library is handed it as a cache folder of its own (OpenVINO's CACHE_DIR fails
    the compile where it cannot write)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
        return True
    except OSError as err:
        warn_once(path, "cannot be written", err)
        return False


def model_digest(model, header: str) -> hashlib._Hash:
    """A running sha256 over what a converted graph of a torch `model` is made of: `header`
    (the runtime, its version, the dtype), the model's class and config, the model room's
    source files and every weight's name, shape, dtype and bytes."""
    import torch

    digest = hashlib.sha256(f"{type(model).__name__}|{header}".encode())
    config = getattr(model, "config", None)
    digest.update(repr(config.to_dict() if hasattr(config, "to_dict") else config).encode())
    for source in sorted((Path(__file__).resolve().parents[1] / "model").rglob("*.py")):
        digest.update(source.read_bytes())
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest
