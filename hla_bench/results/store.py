"""The results store: the one way a results file (bench points, recall runs) is written.

A results file is YAML with this top-level layout, in this order:

    kind: bench               # or recall; always the first line
    schema_version: 2         # the kind's schema; files written here have 2 or more
    ...                       # the caller's header (config, environment, ...)
    settings: {...}           # what must match for a resume (see `settings_conflicts`)
    points: [...]             # the records (`runs` for recall), one per key
    complete: false           # true once the plan ran to its end (close(complete=True))
    end_of_results: true      # the completion marker, always the last line

Invariants:
- The file on disk is always a whole, valid document: every write goes to a unique
  temporary file in the same folder, is flushed to disk, then atomically renamed over the
  target. A writer killed at any moment leaves the previous version or the new one.
- A document ends with the line `end_of_results: true`; a file that does not (cut short
  by a copy, a full disk, a plain write of an older version) is rejected when read.
  Schema version 1 files predate the store and have no marker; they are read as they are
  but never resumed.
- One writer per file: a lock file `<file>.lock` held with flock(2) names the writer's pid.
  A second writer is refused (naming that pid); the lock of a dead process is taken over
  (the kernel drops a flock with its holder, whatever the pid the file names).
- A file that is not a results file of the store's kind (a config, markdown, a recall
  file for a bench run) is never overwritten, in any mode (`check_out`, the policy verify's
  --yaml shares).
- Nothing is written through a symbolic link: a results file or a lock that is one is
  refused (`hla_bench.safe_files`), and a lock that is not a regular file of one name (a
  FIFO, a hard link to another file) is never truncated.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import errno
import os
import re
import secrets
import signal
import socket
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, Mapping

import yaml

from hla_bench.results.load import (FILE_KINDS, FIRST_STORE_SCHEMA, MARKER_KEY, MARKER_LINE,
                                     RECORDS_KEY, SAFE_LOADER, StoreError, check_structure,
                                     file_kind, load)
from hla_bench.safe_files import (UnsafePathError, open_new_nofollow, open_nofollow,
                                  replace_atomically, temp_prefix)

MODES = ("new", "resume", "overwrite")
STORE_KEYS = ("settings", "complete", MARKER_KEY)  # written by the store, after the header
DEFAULT_FOLDER = Path("runs")


class _Dumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):
    """Safe YAML (libyaml's emitter where it is built: a file is rewritten after every
    record, so its speed matters), without anchors: a value that appears twice is written
    twice, so every record reads back on its own."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


class LockedError(StoreError):
    """Another live process holds the file's lock."""


# ---------------------------------------------------------------- resuming


def read_resumable(path: str | Path, kind: str, settings: Mapping[str, Any],
                   validate: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """The results file at `path`, checked as a resume with `settings` checks it (whole, of
    `kind`, a resumable schema, the same settings), without taking its lock; StoreError
    naming what is wrong otherwise."""
    try:
        data = load(path, kind, validate)
    except StoreError as error:
        raise StoreError(f"cannot resume {error}") from None
    if data["schema_version"] < FIRST_STORE_SCHEMA:
        raise StoreError(f"cannot resume {path}: schema version {data['schema_version']} "
                         "predates resumable files (no settings, no completion marker); "
                         "write to a new file")
    conflicts = settings_conflicts(data["settings"], settings)
    if conflicts:
        raise StoreError(f"cannot resume {path}: its settings differ from this run's: "
                         + "; ".join(conflicts))
    return data


def dump_results(data: Mapping[str, Any]) -> str:
    """The YAML text of a document, keys in their order; for store schemas it must end with
    the marker (the document was built with `STORE_KEYS` last)."""
    text = yaml.dump(dict(data), Dumper=_Dumper, sort_keys=False, default_flow_style=None,
                     width=100, allow_unicode=True)
    if data.get("schema_version", 0) >= FIRST_STORE_SCHEMA and not text.endswith(MARKER_LINE):
        raise StoreError(f"a results document must end with {MARKER_KEY}: true")
    return text


# ---------------------------------------------------------------- writing


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write `text` to `path` so that a reader (or a crash at any moment) sees either the
    old file or the whole new one (`safe_files.replace_atomically`: a temporary file in
    the same folder, fsync, os.replace; a symbolic link at `path` is refused with
    UnsafePathError, never written through). The folder must exist."""
    return replace_atomically(path, text)


def check_writable(path: str | Path) -> Path:
    """Create `path`'s folder if needed and prove a file can be written there, before any
    work starts; StoreError naming the path otherwise."""
    path = Path(path)
    if path.is_symlink():
        raise StoreError(f"{path}: is a symbolic link; refusing to write through it or to "
                         "replace it (remove the link, or give another path)")
    if path.is_dir():
        raise StoreError(f"{path}: is a folder, expected a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent)
        os.close(fd)
        os.unlink(temp)
    except OSError as error:
        raise StoreError(f"{path}: cannot write in {path.parent} ({error.strerror or error})") \
            from None
    return path


def check_out(path: str | Path, kind: str, mode: str,
              kind_of: Callable[[Path], str | None] = file_kind) -> bool:
    """The policy of every command that writes a file of `kind` to a path it is given
    (bench's and recall's --out, verify's --yaml): whether a file is there (False: it is
    written afresh). A symbolic link is refused; so is an existing file that is not of
    `kind` (`kind_of(path)`: the kind named by its first lines), in every mode; and, of
    `kind`, one in mode "new" (without --resume or --overwrite). Modes: "new", "resume",
    "overwrite"; a kind written in modes new and overwrite only names --overwrite.
    StoreError naming the path otherwise."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (expected {', '.join(MODES)})")
    path = Path(path)
    if path.is_symlink():
        raise StoreError(f"{path}: is a symbolic link; refusing to write through it or to "
                         "replace it (remove the link, or give another path)")
    if not path.exists():
        return False
    if path.is_dir():
        raise StoreError(f"{path}: is a folder, expected a file name")
    found = kind_of(path)
    refusing = "refusing to resume it" if mode == "resume" else "refusing to overwrite it"
    if found not in FILE_KINDS:
        noun = "a results file" if kind in RECORDS_KEY else f"a {kind} output"
        raise StoreError(f"{path} exists and is not {noun} (it does not start with "
                         f"'kind: {kind}' and a schema_version); {refusing}")
    if found != kind:
        raise StoreError(f"{path} is a {found} results file, not {kind}; {refusing}")
    if mode == "new":
        how = ("resume it (--resume) or replace it (--overwrite)" if kind in RECORDS_KEY
               else "give --overwrite to replace it")
        raise StoreError(f"{path} already exists; {how}")
    return True


def default_out_path(kind: str, folder: str | Path = DEFAULT_FOLDER,
                     now: dt.datetime | None = None) -> Path:
    """`runs/<kind>-<UTC time>-<pid>-<random>.yaml`: distinct for runs started in the same
    second, on one host (pid) or sharing a folder across hosts (random suffix)."""
    if kind not in RECORDS_KEY:
        raise ValueError(f"unknown results kind {kind!r}")
    now = now or dt.datetime.now(dt.timezone.utc)
    return Path(folder) / (f"{kind}-{now.strftime('%Y%m%dT%H%M%SZ')}-{os.getpid()}-"
                           f"{secrets.token_hex(4)}.yaml")


# ---------------------------------------------------------------- the lock


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lock_holder(lock_path: Path) -> tuple[int | None, str]:
    """(pid, host) named by a lock file; (None, '') when it names none."""
    try:
        fields = lock_path.read_text().split()
    except OSError:
        return None, ""
    try:
        return int(fields[0]), (fields[1] if len(fields) > 1 else "")
    except (IndexError, ValueError):
        return None, ""


def _not_a_lock_file(fd: int) -> str | None:
    """Why the open file `fd` is not one to truncate as a lock: not a regular file (a FIFO,
    a device), or a name of a file that has others (a hard link to some other file)."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_nlink != 1:
        return f"has {info.st_nlink} names (a hard link to another file)"
    return None


class FileLock:
    """An exclusive, non-blocking lock on `<path>.lock` (flock), whose content is the
    holder's `pid host`. Where flock is unsupported (some network file systems) the pid
    decides: a lock naming a live process on this host is held, any other is stale; that
    fallback is best effort (two processes taking over one stale lock at the same instant
    can both succeed), the flock is not."""

    def __init__(self, path: str | Path):
        self.target = Path(path)
        self.path = self.target.with_name(self.target.name + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        for _ in range(20):  # retried when the lock file is replaced while we lock it
            try:  # never through a symbolic link: a planted one would truncate its target
                fd = open_nofollow(self.path, os.O_RDWR | os.O_CREAT, 0o644, what="lock")
            except UnsafePathError as error:
                raise StoreError(f"{self.target}: cannot take the lock: {error.strerror}") \
                    from None
            except OSError as error:
                raise StoreError(f"{self.target}: cannot create the lock {self.path.name} "
                                 f"in {self.path.parent} ({error.strerror or error})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(fd)
                if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    self._refuse()
                if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                    raise StoreError(f"{self.target}: cannot lock {self.path.name} "
                                     f"({error.strerror or error})") from None
                self._acquire_by_pid()
                return
            # The holder before us may have removed the lock file between our open and our
            # flock: then we hold a lock on a name no longer in the folder; start again.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            problem = _not_a_lock_file(fd)
            if problem:
                os.close(fd)
                raise StoreError(f"{self.target}: the lock {self.path} {problem}; refusing "
                                 "to write it (remove it)")
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
            os.fsync(fd)
            self._fd = fd
            return
        raise StoreError(f"{self.target}: could not take the lock {self.path.name}")

    def _refuse(self) -> None:
        pid, host = _lock_holder(self.path)
        who = f"pid {pid}" + (f" on {host}" if host else "") if pid is not None else "another process"
        if pid is not None and host == socket.gethostname() and not _pid_alive(pid):
            who += " (no longer running: a process it started still holds the lock)"
        raise LockedError(f"{self.target} is being written by {who} (lock {self.path}); "
                          "wait for it to finish, or write to another file")

    def _acquire_by_pid(self) -> None:
        """No flock here: take the lock by creating it exclusively, or over a stale one."""
        pid, host = _lock_holder(self.path)
        if pid is not None and host == socket.gethostname() and _pid_alive(pid):
            self._refuse()
        if self.path.is_symlink():
            raise StoreError(f"{self.target}: the lock {self.path} is a symbolic link; "
                             "refusing to replace it (remove the link)")
        self.path.unlink(missing_ok=True)
        try:
            fd = open_new_nofollow(self.path, os.O_RDWR, 0o644, what="lock")
        except FileExistsError:
            self._refuse()
        except UnsafePathError as error:
            raise StoreError(f"{self.target}: cannot take the lock: {error.strerror}") \
                from None
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Remove the lock file (while still holding it, so no one locks the removed name
        unawares) and drop the lock. Safe to call more than once."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass
        try:
            os.close(self._fd)
        finally:
            self._fd = None


# Stores open in this process: released at interpreter exit and by the SIGTERM handler.
_OPEN: set["ResultsStore"] = set()
_previous_sigterm: Any = None


def _raise_on_sigterm(signum, frame):
    """SIGTERM ends the process through SystemExit, so `finally` blocks and context managers
    run and the locks are released (the default action would end it at once)."""
    raise SystemExit(128 + signum)


def _install_sigterm_handler() -> None:
    global _previous_sigterm
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        _previous_sigterm = signal.signal(signal.SIGTERM, _raise_on_sigterm)


def _restore_sigterm_handler() -> None:
    global _previous_sigterm
    if (_previous_sigterm is not None and not _OPEN
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is _raise_on_sigterm):
        signal.signal(signal.SIGTERM, _previous_sigterm)
        _previous_sigterm = None


@atexit.register
def _release_all() -> None:
    for store in list(_OPEN):
        store.release()


# ---------------------------------------------------------------- settings


def _normalized(value: Any) -> Any:
    """`value` as it reads back from YAML (tuples become lists, ...)."""
    return yaml.load(yaml.dump(value, Dumper=_Dumper, sort_keys=False), Loader=SAFE_LOADER)


def _merged(stored: Mapping[str, Any], planned: Mapping[str, Any]) -> dict[str, Any]:
    """`stored` with `planned`'s keys added, recursively into mappings both have."""
    merged = dict(stored)
    for key, value in planned.items():
        old = merged.get(key)
        merged[key] = (_merged(old, value) if isinstance(old, dict) and isinstance(value, dict)
                       else value)
    return merged


def settings_conflicts(stored: Mapping[str, Any], planned: Mapping[str, Any],
                       prefix: str = "") -> list[str]:
    """`key: file X, this run Y` for every setting the two sides both have with different
    values; mappings are compared key by key (dotted names). A key only one side has is no
    conflict: the file may hold sweeps the plan does not, and the reverse."""
    conflicts = []
    for key in stored:
        if key not in planned:
            continue
        old, new = stored[key], planned[key]
        if isinstance(old, dict) and isinstance(new, dict):
            conflicts += settings_conflicts(old, new, f"{prefix}{key}.")
        elif old != new:
            conflicts.append(f"{prefix}{key}: file {old!r}, this run {new!r}")
    return conflicts


# ---------------------------------------------------------------- the store


class ResultsStore:
    """One results file being written: its header, settings and records by key, kept on
    disk after every change. Open it with `ResultsStore.open`; use it as a context manager
    (or call `close`) so its lock is released."""

    def __init__(self, path: Path, kind: str, key: Callable[[Mapping[str, Any]], Hashable],
                 settings: dict[str, Any], header: dict[str, Any],
                 validate: Callable[[dict], Any] | None, lock: FileLock):
        self.path, self.kind, self.key = path, kind, key
        self.settings, self.header = settings, header
        self.validate, self.lock = validate, lock
        self.previous_header: dict[str, Any] | None = None
        self.kept = 0          # records read from the file at open (resume)
        self.mode = "new"
        self.writes = 0        # files written by this store (0: the path is as it was at open)
        self.complete = False
        self._records: dict[Hashable, dict[str, Any]] = {}
        self._closed = False

    @classmethod
    def open(cls, path: str | Path, *, kind: str, key: Callable[[Mapping[str, Any]], Hashable],
             settings: Mapping[str, Any], mode: str,
             header: Mapping[str, Any] | Callable[[dict | None], Mapping[str, Any]],
             validate: Callable[[dict], Any] | None = None) -> "ResultsStore":
        """Lock `path` and prepare to write it; nothing is written before the first `add`
        or `close` (a run stopped before then leaves any existing file as it was).

        kind: "bench" or "recall" (the records go under `points` or `runs`).
        key(record): what identifies a record across runs; `add` replaces a record with an
            equal key.
        settings: what must match for a resume (see `settings_conflicts`); stored in the file.
        mode: "new" refuses an existing file; "resume" continues one (or starts a missing
            one), keeping every record it holds, and refuses one whose settings conflict;
            "overwrite" replaces a results file of the same kind. No mode replaces a file
            that is not a results file of `kind`.
        header: the top-level fields written before the settings (must hold
            `schema_version` >= FIRST_STORE_SCHEMA), or a function of the resumed file's
            header (None when there is none) giving them.
        validate(document): the kind's own checks, run on a resumed file and before every
            write; raises ValueError.
        Problems are StoreError (LockedError for a file another process writes).
        """
        if kind not in RECORDS_KEY:
            raise ValueError(f"unknown results kind {kind!r} (expected {', '.join(RECORDS_KEY)})")
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} (expected {', '.join(MODES)})")
        path = Path(path)
        check_writable(path)
        lock = FileLock(path)
        lock.acquire()
        try:
            store = cls(path, kind, key, _normalized(dict(settings)), {}, validate, lock)
            store.mode = mode
            previous = store._inspect(mode)
            made = header(previous["header"] if previous else None) if callable(header) else header
            store.header = store._checked_header(made)
            if previous:
                store.previous_header = previous["header"]
                for record in previous["records"]:
                    store._records[key(record)] = record
                store.kept = len(store._records)
            store._remove_stale_temporaries()
        except BaseException:
            lock.release()
            raise
        _OPEN.add(store)
        _install_sigterm_handler()
        return store

    def _inspect(self, mode: str) -> dict[str, Any] | None:
        """Apply `mode` to what is at the path: None when the file starts afresh, else the
        resumed file's header and records."""
        path = self.path
        if not check_out(path, self.kind, mode) or mode == "overwrite":
            return None
        data = read_resumable(path, self.kind, self.settings, self.validate)
        records_key = RECORDS_KEY[self.kind]
        header = {k: v for k, v in data.items()
                  if k not in ("kind", records_key, *STORE_KEYS)}
        # Keys the new plan does not have stay as the file recorded them.
        self.settings = _merged(data["settings"], self.settings)
        return {"header": header, "records": data[records_key]}

    def _checked_header(self, header: Mapping[str, Any]) -> dict[str, Any]:
        header = dict(header)
        reserved = sorted(set(header) & {"kind", RECORDS_KEY[self.kind], *STORE_KEYS})
        if reserved:
            raise ValueError(f"the header must not hold the store's keys {reserved}")
        version = header.get("schema_version")
        if isinstance(version, bool) or not isinstance(version, int) or version < FIRST_STORE_SCHEMA:
            raise ValueError(f"the header's schema_version must be an integer >= "
                             f"{FIRST_STORE_SCHEMA}, got {version!r}")
        return _normalized({"schema_version": version, **header})

    def _remove_stale_temporaries(self) -> None:
        """Temporary files of this target left by a writer that was killed mid-write (only
        the lock holder writes, and we hold the lock)."""
        prefix = temp_prefix(self.path)
        for leftover in self.path.parent.glob(f"{glob_escape(prefix)}*.tmp"):
            try:
                leftover.unlink()
            except OSError:
                pass

    # ------------------------------------------------------------ records

    def records(self) -> list[dict[str, Any]]:
        """The records in file order (resumed ones first, then added ones); copies."""
        return [dict(record) for record in self._records.values()]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.records())

    def __len__(self) -> int:
        return len(self._records)

    def has(self, key: Hashable) -> bool:
        return key in self._records

    def get(self, key: Hashable) -> dict[str, Any] | None:
        record = self._records.get(key)
        return dict(record) if record is not None else None

    def add(self, record: Mapping[str, Any]) -> None:
        """Replace the record with the same key (in its place) or append it; then write the
        file. The record is stored as it reads back from YAML. When the write fails (the
        kind's validation, a full disk, an interruption) the store keeps what the file
        holds, without the record."""
        self._check_open()
        record = _normalized(dict(record))
        record_key = self.key(record)
        before = self._records.get(record_key)
        self._records[record_key] = record
        try:
            self.write()
        except BaseException:
            if before is None:
                del self._records[record_key]
            else:
                self._records[record_key] = before
            raise

    def update_header(self, changes: Mapping[str, Any], *, write: bool = True) -> None:
        """Change header fields (e.g. a wall time, a summary of the records); with `write`
        False they are written by the next `add` or `close`."""
        self._check_open()
        before = self.header
        self.header = self._checked_header({**self.header, **changes})
        if write:
            try:
                self.write()
            except BaseException:
                self.header = before
                raise

    def document(self) -> dict[str, Any]:
        """The whole document as the file holds it after the next write."""
        return {"kind": self.kind, **self.header, "settings": self.settings,
                RECORDS_KEY[self.kind]: [dict(r) for r in self._records.values()],
                "complete": self.complete, MARKER_KEY: True}

    def write(self) -> dict[str, Any]:
        """Validate the document and write it atomically; returns it."""
        data = self.document()
        check_structure(data, self.kind)
        if self.validate is not None:
            self.validate(data)
        atomic_write_text(self.path, dump_results(data))
        self.writes += 1
        return data

    def close(self, complete: bool = True) -> dict[str, Any]:
        """Write the file (`complete` records whether the plan ran to its end) and release
        the lock; returns the document written."""
        self._check_open()
        self.complete = complete
        try:
            return self.write()
        finally:
            self.release()

    def release(self) -> None:
        """Release the lock without writing (the file keeps its last written version)."""
        self._closed = True
        self.lock.release()
        _OPEN.discard(self)
        _restore_sigterm_handler()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self.path}: the store is closed")

    def __enter__(self) -> "ResultsStore":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        """On an exception (SIGINT, SIGTERM, an error) the file keeps its last written
        version, every record added so far, and the lock is released."""
        if not self._closed:
            if exc_type is None:
                self.close(complete=True)
            else:
                self.release()


@contextlib.contextmanager
def exit_on_interrupt(store: "ResultsStore", noun: str, say: Callable[[str], None]):
    """Ctrl-C inside: the file keeps its last written version (every record added so far;
    the store's own __exit__ releases the lock), `say` tells what it holds and how to go
    on, and the process exits with status 130, as shells report SIGINT. Before the store's
    first write the path is as it was at open: with --overwrite an existing file still
    holds the earlier run's records, none of this run's."""
    try:
        yield
    except KeyboardInterrupt:
        path = store.path
        if not Path(path).exists():
            say(f"interrupted before any {noun} was written: {path} was not created")
        elif store.writes == 0 and store.mode == "overwrite":
            say(f"interrupted before any {noun} was written: {path} is unchanged, it still "
                f"holds the earlier results{_held(path, store.kind, noun)}; to replace them, "
                "run the same command again")
        else:
            say(f"interrupted: {len(store)} {noun}(s) kept in {path}; to continue, run "
                f"the same command with --resume --out {path}")
        raise SystemExit(130) from None


def _held(path: Path, kind: str, noun: str) -> str:
    """` (N noun(s))`: how many records the results file at `path` holds; empty where it
    cannot be read."""
    try:
        return f" ({len(load(path, kind)[RECORDS_KEY[kind]])} {noun}(s))"
    except StoreError:
        return ""


def glob_escape(text: str) -> str:
    """`text` with glob's special characters quoted."""
    return re.sub(r"([*?\[])", r"[\1]", text)


def lock_holder(path: str | Path) -> tuple[int, str, bool | None] | None:
    """Who writes the results file `path`, as its lock file `<path>.lock` names it: (pid,
    host, alive), alive None where the host is another one (its processes cannot be seen
    from here); None when there is no lock naming a pid. Only reads the lock file."""
    pid, host = _lock_holder(Path(f"{path}.lock"))
    if pid is None:
        return None
    here = host == socket.gethostname()
    return pid, host, _pid_alive(pid) if here else None
