"""Files that readers never see half-written (atomic rename), and their sha256."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)


def not_a_file(path) -> str | None:
    """What stands at `path` (symlinks followed) if it is something other than a regular
    file, e.g. "a character device"; None for a regular file or nothing."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError:  # e.g. a loop of symlinks: let the write itself report it
        return None
    return next(
        (kind for test, kind in _KINDS if test(mode)), None if stat.S_ISREG(mode) else "not a regular file"
    )


def output_file(path) -> Path:
    """Where an output file named `path` is written: `path` itself, or, if it is a symlink,
    the file it points to (written through: the link stays and now names the new file).
    An output is only ever a regular file or a new path: a device (/dev/null, /dev/full),
    FIFO, socket or directory standing there raises OSError naming `path`, and is never
    replaced by the rename."""
    path = Path(path)
    kind = not_a_file(path)
    if kind is not None:
        raise OSError(
            errno.EEXIST, f"is {kind}; an output is written only to a regular file or a new path", str(path)
        )
    return Path(os.path.realpath(path)) if path.is_symlink() else path


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path beside the output `path` (output_file: a symlink's target);
    rename it over that only on success, and only if a regular file or nothing is still
    there (checked again just before the rename)."""
    target = output_file(path)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        try:
            yield tmp
        except OSError as err:
            if err.filename is None:  # e.g. numpy's short write: name the file being written
                raise OSError(err.errno, err.strerror or str(err), str(path)) from err
            raise
        output_file(path)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def atomic_folder(path):
    """Yield a new temporary folder beside `path`; on success it replaces `path`, on failure
    it is deleted and `path` is untouched. An older folder of that name is first renamed
    aside, the new one renamed in, and only then the old one removed: at every instant one
    complete folder exists under its own or an aside name (`.NAME.old-*`). A symlink is
    written through (the folder it names is replaced); anything at `path` that is not a
    directory (a file, a device) raises OSError and is left as it is.

    The folder and what is written in it get the modes the user's umask gives (a temporary
    folder is made 0700, and some writers' files 0600: not what a saved model should be).
    Temporary and aside folders of `path` left by a process that died (kill -9 during a
    save) are removed first: only names this function makes, of a process no longer
    running, older than a minute."""
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    if path.exists() and not path.is_dir():
        raise OSError(
            errno.ENOTDIR, "exists and is not a folder; give a new path or a folder to replace", str(path)
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent))
    try:
        yield tmp
        apply_umask(tmp)
        replace_folder(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def replace_folder(complete: Path, path: Path) -> None:
    """Rename the folder `complete` to `path`. A folder already at `path` is first renamed
    aside (`.NAME.old-PID`) and removed only after, so that one complete folder exists
    under its own or an aside name at every instant (remove_stale_temporaries clears an
    aside a crash left)."""
    aside = None
    if path.exists():
        aside = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, aside)
    os.replace(complete, path)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def current_umask() -> int:
    """This process's umask (from /proc where it says; else set and restored at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(folder: Path) -> None:
    """Give `folder`, and every folder and file under it, the mode a plain mkdir / open
    would have given under the umask (0777 / 0666 less the umask)."""
    mask = current_umask()
    os.chmod(folder, 0o777 & ~mask)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)(?:-\w+)?$")
STALE_AFTER_S = 60.0


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Remove `.NAME.tmp-PID[-x]` and `.NAME.old-PID` entries beside `path` (what
    atomic_path and atomic_folder make) whose process is no longer running and that are
    older than STALE_AFTER_S. -> what was removed."""
    import time

    removed = []
    if not path.parent.is_dir():
        return removed
    for entry in path.parent.iterdir():
        match = _TEMPORARY.match(entry.name)
        if not match or match.group("name") != path.name or process_running(int(match.group("pid"))):
            continue
        try:
            if time.time() - entry.lstat().st_mtime < STALE_AFTER_S:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError:
            continue  # not ours to remove after all (permissions): leave it
        removed.append(entry)
    return removed


def process_running(pid: int) -> bool:
    """Whether process `pid` runs (this one, or another user's, counts as running)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        return True
    return True


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


def files_digest(paths, name_of) -> str:
    """Hex sha256 over files (each `name_of(path)` and its sha256, in the order given; a path
    that is not a file is left out): what a run records to notice inputs changed in place."""
    digest = hashlib.sha256()
    for path in paths:
        if os.path.isfile(path):
            digest.update(f"{name_of(path)}\0{sha256_file(path)}\n".encode())
    return digest.hexdigest()


def describe_os_error(err: OSError, where: str | None = None) -> str:
    """One line for an error of the operating system (no space left, permission denied, not
    a directory, file too large): the path and the reason, never a traceback. `where`: what to
    name instead of the error's own path (an output written through a temporary: the output)."""
    where = where or (err.filename if err.filename is not None else "a file")
    reason = err.strerror or str(err)
    # numpy's short write has no errno: "N requested and M written" (not our own "is a
    # directory; an output is written only to a regular file", which is no space problem)
    if err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) or re.search(
        r"requested and \d+ written", reason
    ):
        reason += " (no space left on the device, or a file-size limit)"
    return f"{where}: {reason}"


def output_over_inputs(output, inputs=(), folders=()) -> str | None:
    """One line if `output` resolves to one of the `inputs` files or into a folder that one
    of the `folders` a command reads resolves into (symlinks followed on both sides: a Hugging
    Face cache snapshot's files are links into ../../blobs, which is then refused too), else
    None: an output never replaces an input. Anything but a regular file standing at `output`
    (a directory, device, FIFO, socket) is refused too: the output is a file, written by
    rename (output_file). An output folder has its own rule: output_folder_mistake.
    """
    if str(output) == "-":  # a shell's "standard output": here it would be a file named "-"
        return "- (standard output) is not an output here: give the output file's path"
    target = Path(output).resolve()
    if target.is_dir():
        return f"{output} is a directory; give the output file's path"
    kind = not_a_file(output)
    if kind is not None:
        return f"{output} is {kind}; an output is written only to a regular file or a new path"
    for path in inputs:
        if Path(path).resolve() == target:
            return f"{output} is also an input ({path}); choose another output path"
    written = {target, Path(os.path.abspath(output))}
    for folder in folders:
        reach = folder_reach(Path(folder))
        if any(place.is_relative_to(r) for place in written for r in reach):
            return f"{output} is inside {folder} (or where its files' links lead), which this command reads; write it elsewhere"
    return None


def output_folder_mistake(output: Path, reads: list[Path], marker: str) -> str | None:
    """One line where writing the output folder `output` (atomic_folder replaces what is there)
    would touch a file or folder the command reads (`reads`: inputs, a tokenizer), or a folder
    that is not an earlier output of the same command (one holding other files and no
    `marker`, the file such an output always holds), else None."""
    target = output.resolve()
    if output.exists() and not output.is_dir():
        return f"--output {output} exists and is not a folder"
    for path in reads:
        place = path.resolve()
        if place.is_relative_to(target) or target.is_relative_to(place):
            return f"--output {output} would replace or lie inside {path}, which this command reads; write elsewhere"
    if output.is_dir() and any(output.iterdir()) and not (output / marker).is_file():
        return f"--output {output} is a folder holding other files (no {marker} of this command); give a new path"
    return None


def folder_reach(folder: Path, max_entries: int = 10_000) -> set[Path]:
    """The folders a model folder's contents live in: the folder itself (as given and
    resolved) and the resolved parent of every file in it (two levels down), so that files
    which are links (a Hugging Face cache snapshot's, into ../../blobs) count too."""
    reach = {Path(os.path.abspath(folder)), folder.resolve()}
    if not folder.is_dir():
        return reach
    for count, entry in enumerate(itertools.chain(folder.glob("*"), folder.glob("*/*"))):
        if count >= max_entries:
            break
        if entry.is_symlink():
            reach.add(entry.resolve().parent)
    return reach


# What decides a model's outputs (weights, configs, tokenizer, pooling): not ONNX / OpenVINO
# exports or READMEs that a folder may carry beside them.
MODEL_FILE_SUFFIXES = (".safetensors", ".json", ".txt", ".model")
EXPORT_FOLDERS = ("onnx", "openvino")


def model_files(folder: Path) -> list[Path]:
    """The files that decide a model's outputs (weights, config.json, tokenizer files,
    sentence-transformers' module configs; two levels down, exports left out), sorted."""
    return sorted(
        p
        for p in itertools.chain(folder.glob("*"), folder.glob("*/*"))
        if p.is_file()
        and p.suffix in MODEL_FILE_SUFFIXES
        and p.relative_to(folder).parts[0] not in EXPORT_FOLDERS
    )


def model_fingerprint(folder) -> str:
    """sha256 over the names and bytes of model_files. Kept work is tied to it: a folder
    re-saved or updated in place gets another fingerprint."""
    folder = Path(folder)
    digest = hashlib.sha256()
    for path in model_files(folder):
        digest.update(str(path.relative_to(folder)).encode() + b"\0" + sha256_file(path).encode())
    return digest.hexdigest()


def model_files_identity(folder) -> str:
    """sha256 over (name, size, mtime in ns, inode) of model_files, without reading them: a
    file re-saved or replaced changes its mtime or inode. What a command keys kept work on
    when it runs every time (embed: hashing every byte of a 4 GiB folder took seconds per run,
    with nothing kept to compare)."""
    folder = Path(folder)
    digest = hashlib.sha256()
    for path in model_files(folder):
        info = path.stat()
        digest.update(
            f"{path.relative_to(folder)}\0{info.st_size}\0{info.st_mtime_ns}\0{info.st_ino}\n".encode()
        )
    return digest.hexdigest()


def open_private(path: Path, keep: bool):
    """Open this command's own temporary file `path` for writing, never through a link and
    never a FIFO or device: `keep` opens an existing regular file to append to; otherwise a
    regular file there is replaced by a new one (O_EXCL). Anything else standing at `path`
    (a symbolic link, FIFO, device, folder) raises OSError naming it: it is not ours."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        what = (
            "a symbolic link"
            if stat.S_ISLNK(mode)
            else next((kind for test, kind in _KINDS if test(mode)), "not a regular file")
        )
        raise OSError(
            errno.EEXIST,
            f"is {what}, not the temporary file this command writes; remove it and run the command again",
            str(path),
        )
    if keep and mode is not None:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    else:
        if mode is not None:
            os.unlink(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the check and the open
        os.close(fd)
        raise OSError(errno.EEXIST, "is not a regular file", str(path))
    return os.fdopen(fd, "r+b")


def regular_file(path: Path) -> bool:
    """A regular file stands at `path` itself (not a link, FIFO or device): safe to read."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


class FolderInUse(RuntimeError):
    """Another process holds the folder's lock."""


def lock_folder(folder, what: str):
    """Take the exclusive lock of `folder` for this process's lifetime (released by the OS
    when the process ends, even on kill -9). The lock file sits beside the folder
    (`.NAME.lock`), so the folder itself holds only what the job writes, and is removed when
    the process exits (while still held: a process that opened it in that instant finds it
    gone after its lock and takes a new one; after kill -9 an empty one stays and is taken
    again). Returns the open lock file (keep a reference); FolderInUse if another process holds it."""
    import fcntl

    # The resolved folder: runs/A -> runs/B and runs/B are one folder with one lock.
    folder = Path(folder).resolve()
    folder.parent.mkdir(parents=True, exist_ok=True)
    path = folder.parent / f".{folder.name}.lock"
    if str(path) in _HELD:  # this process holds it already (a job run twice in one process)
        return _HELD[str(path)]
    while True:
        handle = open(path, "a+")  # noqa: SIM115 - held open on purpose
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise FolderInUse(
                f"{folder} is in use by another {what} (lock {path}); wait for it to end"
            ) from None
        if _same_file(handle, path):
            break
        handle.close()  # its holder removed it as we opened it: take the new one
    if not _HELD:
        import atexit

        atexit.register(_remove_held_locks)
    _HELD[str(path)] = handle
    return handle


def release_folder(folder) -> None:
    """Give back the lock lock_folder took on `folder` in this process (its file removed while
    held, as at exit); nothing where this process holds none. For a job run inside a longer
    process (a library call, a notebook) that ends before the process does."""
    folder = Path(folder).resolve()  # the lock's path as lock_folder names it
    path = str(folder.parent / f".{folder.name}.lock")
    handle = _HELD.pop(path, None)
    if handle is not None:
        if _same_file(handle, Path(path)):
            with contextlib.suppress(OSError):
                os.unlink(path)
        handle.close()


def _same_file(handle, path: Path) -> bool:
    """Whether `path` still names the file `handle` has open."""
    try:
        return os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
    except OSError:
        return False


def _remove_held_locks() -> None:
    """At exit: each lock file this process holds, removed while held, then closed."""
    for path, handle in list(_HELD.items()):
        if _same_file(handle, Path(path)):
            with contextlib.suppress(OSError):
                os.unlink(path)
        handle.close()
        del _HELD[path]


_HELD: dict = {}  # lock file path -> open file, for this process's lifetime
