"""How the harness creates and replaces files, and how a name becomes a path.

Invariants (every file the harness writes goes through here: results files and their
locks, plots, results indexes, verify output, checkpoints):
- No write follows a symbolic link at the final component of its path. A new file is
  opened with O_CREAT | O_EXCL | O_NOFOLLOW (`open_new_nofollow`); a file opened to be
  kept open (a lock) with O_NOFOLLOW (`open_nofollow`); a replaced file is written to a
  fresh temporary file in the same folder (mkstemp opens it with O_EXCL and O_NOFOLLOW),
  flushed to disk and renamed over the target (`replace_atomically`). A target that is a
  symbolic link is refused (UnsafePathError), never written through nor replaced: the link
  and what it points to stay as they were.
- A name read from a config or a results file (a sweep name, a plot stem, a checkpoint
  name) joins a folder only once it is one plain path component (`plain_name`,
  `path_in`): no separator, no NUL or control character, not `.` or `..`, not hidden
  (a leading `.`), not empty. A bad name is an UnsafeNameError naming the value.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

# O_NOFOLLOW is POSIX; where it is missing, the lstat check before each open is the guard.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# The longest name most file systems take (bytes, UTF-8).
MAX_NAME_BYTES = 255


class UnsafePathError(OSError):
    """A file the harness would write is a symbolic link (or is replaced by one while it
    is written); the message names the path."""


class UnsafeNameError(ValueError):
    """A name from a config or a results file that cannot be one plain path component;
    the message names the value and what it is."""


def name_problem(name: object) -> str | None:
    """Why `name` cannot be one plain file-name component, or None when it can."""
    if not isinstance(name, str):
        return f"expected a string, got {type(name).__name__}"
    if not name:
        return "it is empty"
    if "\0" in name:
        return "it holds a NUL character"
    if any(ord(char) < 32 or ord(char) == 127 for char in name):
        return "it holds a control character"
    if "/" in name or "\\" in name:
        return "it holds a path separator ('/' or '\\')"
    if name in (".", ".."):
        return "it names a folder ('.' or '..')"
    if name.startswith("."):
        return "it starts with '.' (a hidden file)"
    if name != name.strip():
        return "it starts or ends with white space"
    if len(name.encode("utf-8", errors="surrogatepass")) > MAX_NAME_BYTES:
        return f"it is longer than {MAX_NAME_BYTES} bytes"
    return None


def plain_name(name: object, what: str) -> str:
    """`name` when it is one plain file-name component (see `name_problem`); otherwise an
    UnsafeNameError saying `what` it is (e.g. "sweep name") and naming the value."""
    problem = name_problem(name)
    if problem:
        raise UnsafeNameError(f"{what} {name!r} cannot be part of a file name: {problem}")
    return name  # type: ignore[return-value]


def path_in(folder: str | Path, name: object, what: str, suffix: str = "") -> Path:
    """`folder / (name + suffix)`, once `name + suffix` is a plain component
    (UnsafeNameError otherwise): the path cannot leave `folder`."""
    plain_name(f"{name}{suffix}" if isinstance(name, str) else name, what)
    return Path(folder) / f"{name}{suffix}"


def refuse_symlink(path: str | Path, what: str = "file") -> Path:
    """`path` as a Path, or UnsafePathError when it is a symbolic link (dangling or not)."""
    path = Path(path)
    if path.is_symlink():
        raise UnsafePathError(errno.ELOOP, f"{path}: the {what} is a symbolic link; refusing "
                              "to write through it or to replace it (remove the link, or "
                              "give another path)")
    return path


def _opened(path: Path, flags: int, mode: int, what: str) -> int:
    refuse_symlink(path, what)
    try:
        return os.open(path, flags | _NOFOLLOW | _CLOEXEC, mode)
    except OSError as error:
        if error.errno == errno.ELOOP or path.is_symlink():  # planted since the check
            refuse_symlink(path, what)
        raise


def open_new_nofollow(path: str | Path, flags: int = os.O_WRONLY, mode: int = 0o644,
                      what: str = "file") -> int:
    """A file descriptor of a file created here at `path` (O_CREAT | O_EXCL: never an
    existing file, never through a symbolic link); FileExistsError when `path` exists,
    UnsafePathError when it is a symbolic link."""
    return _opened(Path(path), flags | os.O_CREAT | os.O_EXCL, mode, what)


def open_nofollow(path: str | Path, flags: int, mode: int = 0o644, what: str = "file") -> int:
    """A file descriptor of `path` opened with `flags` (O_CREAT among them creates it),
    never through a symbolic link at its final component (UnsafePathError)."""
    return _opened(Path(path), flags, mode, what)


def _fsync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable (where the platform allows opening a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_prefix(path: Path) -> str:
    """The name prefix of `path`'s temporary files (hidden, in its folder)."""
    return f".{path.name}."


def _file_mode(path: Path) -> int:
    """The permissions a replaced file keeps; for a new one, what open() would give it."""
    try:
        return os.lstat(path).st_mode & 0o7777
    except OSError:
        umask = os.umask(0o022)
        os.umask(umask)
        return 0o666 & ~umask


def replace_atomically(path: str | Path, content: str | bytes | Callable[[BinaryIO], None],
                       what: str = "file") -> Path:
    """Write `content` (text as UTF-8, bytes, or a function writing into the binary file
    it is given) to `path`, so that a reader, or a crash at any moment, sees either the old
    file or the whole new one: a unique temporary file in the same folder (two writers
    never share it), fsync, then os.replace. A `path` that is a symbolic link is refused
    (UnsafePathError), before and after the temporary file is written. The folder must
    exist."""
    path = refuse_symlink(path, what)
    fd, temp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _file_mode(path))  # mkstemp's 0600 would hide results from others
        with os.fdopen(fd, "wb") as handle:
            if callable(content):
                content(handle)
            else:
                handle.write(content.encode("utf-8") if isinstance(content, str) else content)
            handle.flush()
            os.fsync(handle.fileno())
        # os.replace never follows a link at `path` (it would replace the link itself);
        # a link planted while the file was written is refused as one found before
        refuse_symlink(path, what)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise
    _fsync_folder(path.parent)
    return path
