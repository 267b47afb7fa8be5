"""The results store: modes, settings on resume, atomic writes, the completion marker,
the lock, default output names."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from hla_bench.results import store
from hla_bench.results.load import load, parse_results
from hla_bench.results.store import LockedError, ResultsStore, StoreError

HEADER = {"schema_version": 2, "config": {"name": "t"}}


def key(record):
    return (record["name"], record["t"])


def open_store(path, mode="new", settings=None, kind="bench", header=None, **kw):
    return ResultsStore.open(path, kind=kind, key=key, settings=settings or {"repeats": 3},
                             mode=mode, header=header or HEADER, **kw)


def written(path, records, settings=None, complete=True):
    with open_store(path, "overwrite", settings) as s:
        for record in records:
            s.add(record)
        s.close(complete=complete)
    return path


def records(n, name="a", **extra):
    return [{"name": name, "t": t, "status": "ok", **extra} for t in range(n)]


def test_new_file_layout_and_records(tmp_path):
    path = tmp_path / "sub" / "r.yaml"
    s = open_store(path)
    assert not path.exists()  # nothing is written before the first record
    s.add({"name": "a", "t": 1, "v": (1, 2)})
    data = load(path, "bench")
    assert list(data) == ["kind", "schema_version", "config", "settings", "points", "complete",
                          "end_of_results"]
    assert data["points"] == [{"name": "a", "t": 1, "v": [1, 2]}] and data["complete"] is False
    assert path.read_text().endswith("\nend_of_results: true\n")
    s.add({"name": "b", "t": 1})
    s.add({"name": "a", "t": 1, "v": 3})  # same key: replaced in its place
    assert s.has(("a", 1)) and not s.has(("a", 2)) and s.get(("a", 1))["v"] == 3
    assert [r["name"] for r in s.records()] == ["a", "b"] and len(s) == 2
    final = s.close()
    assert final["complete"] is True and load(path)["complete"] is True
    assert not (tmp_path / "sub" / "r.yaml.lock").exists()
    with pytest.raises(StoreError, match="closed"):
        s.add({"name": "c", "t": 0})


def test_new_refuses_an_existing_file(tmp_path):
    path = written(tmp_path / "r.yaml", records(2))
    before = path.read_text()
    with pytest.raises(StoreError, match=r"r\.yaml already exists; resume it \(--resume\) or "
                                         r"replace it \(--overwrite\)"):
        open_store(path, "new")
    assert path.read_text() == before and not Path(str(path) + ".lock").exists()


@pytest.mark.parametrize("mode", store.MODES)
@pytest.mark.parametrize("content", [
    "name: cpu-smoke\nmixers: [hla2]\nseq_lens: [64]\n",       # a sweep config
    "# Results\n\n| T | ms |\n",                              # markdown
    "",                                                       # empty
    "kind: bench\n",                                          # a header without its version
])
def test_a_file_that_is_not_a_results_file_is_never_replaced(tmp_path, mode, content):
    path = tmp_path / "x.yaml"
    path.write_text(content)
    with pytest.raises(StoreError, match=r"x\.yaml exists and is not a results file"):
        open_store(path, mode)
    assert path.read_text() == content


@pytest.mark.parametrize("mode", store.MODES)
def test_a_results_file_of_another_kind_is_never_replaced(tmp_path, mode):
    path = tmp_path / "recall.yaml"
    with open_store(path, kind="recall") as s:
        s.add({"name": "a", "t": 0})
    before = path.read_text()
    with pytest.raises(StoreError, match="is a recall results file, not bench"):
        open_store(path, mode, kind="bench")
    assert path.read_text() == before


def test_overwrite_replaces_a_results_file_of_the_same_kind(tmp_path):
    path = written(tmp_path / "r.yaml", records(3))
    with open_store(path, "overwrite", {"repeats": 99}) as s:
        assert s.records() == [] and s.kept == 0
        s.add({"name": "new", "t": 0})
    data = load(path)
    assert [r["name"] for r in data["points"]] == ["new"] and data["settings"] == {"repeats": 99}


def test_resume_keeps_every_record_and_adds_the_missing(tmp_path):
    path = written(tmp_path / "r.yaml", records(3) + records(1, name="other"), complete=False)
    with open_store(path, "resume") as s:
        assert s.kept == 4 and s.has(("other", 0))
        s.add({"name": "a", "t": 1, "status": "redone"})
        s.add({"name": "b", "t": 0})
    points = load(path)["points"]
    assert [(p["name"], p["t"]) for p in points] == [("a", 0), ("a", 1), ("a", 2), ("other", 0),
                                                     ("b", 0)]
    assert points[1]["status"] == "redone"


def test_resume_of_a_missing_file_starts_it(tmp_path):
    with open_store(tmp_path / "r.yaml", "resume") as s:
        assert s.kept == 0 and s.previous_header is None
        s.add({"name": "a", "t": 0})
    assert len(load(tmp_path / "r.yaml")["points"]) == 1


def test_resume_refuses_other_settings_naming_each_key(tmp_path):
    path = written(tmp_path / "r.yaml", records(2),
                   settings={"repeats": 1, "dtype": "float32", "sweeps": {"a": {"heads": 2}}})
    before = path.read_text()
    with pytest.raises(StoreError) as error:
        open_store(path, "resume", {"repeats": 20, "dtype": "float32",
                                    "sweeps": {"a": {"heads": 4}, "b": {"heads": 8}}})
    message = str(error.value)
    assert "cannot resume" in message and "r.yaml" in message
    assert "repeats: file 1, this run 20" in message
    assert "sweeps.a.heads: file 2, this run 4" in message
    assert "dtype" not in message and "sweeps.b" not in message
    assert path.read_text() == before


def test_settings_only_one_side_has_are_no_conflict_and_are_kept(tmp_path):
    path = written(tmp_path / "r.yaml", records(1), settings={"sweeps": {"a": {"heads": 2}}})
    with open_store(path, "resume", {"sweeps": {"b": {"heads": 8}}}) as s:
        assert s.settings == {"sweeps": {"a": {"heads": 2}, "b": {"heads": 8}}}
    assert load(path)["settings"] == {"sweeps": {"a": {"heads": 2},
                                                               "b": {"heads": 8}}}


def test_resume_gives_the_previous_header_to_a_header_function(tmp_path):
    path = written(tmp_path / "r.yaml", records(1))
    seen = []

    def header(previous):
        seen.append(previous)
        return {**HEADER, "runs_before": 1 + (previous or {}).get("runs_before", 0)}

    with ResultsStore.open(path, kind="bench", key=key, settings={"repeats": 3},
                           mode="resume", header=header) as s:
        assert s.previous_header == {"schema_version": 2, "config": {"name": "t"}}
    assert seen == [{"schema_version": 2, "config": {"name": "t"}}]
    assert load(path)["runs_before"] == 1


def test_resume_refuses_a_schema_1_file(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"kind": "bench", "schema_version": 1, "points": []},
                                   sort_keys=False))
    with pytest.raises(StoreError, match="schema version 1 predates resumable files"):
        open_store(path, "resume")
    assert load(path)["schema_version"] == 1  # still readable


def test_a_file_cut_at_any_byte_is_rejected(tmp_path):
    path = written(tmp_path / "r.yaml", records(3, extra="x" * 5), settings={"repeats": 3})
    text = path.read_text()
    parse_results(text)  # the whole file is valid
    cut = tmp_path / "cut.yaml"
    header = len("kind: bench\nschema_version: 2\n")
    for end in range(len(text)):
        # once the header is whole, every cut says so, wherever YAML parsing stops
        with pytest.raises(StoreError, match="cut short" if end >= header else None):
            parse_results(text[:end])
    for end in (len(text) - 1, len(text) - 5, len(text) // 2, 40):
        cut.write_text(text[:end])
        with pytest.raises(StoreError, match=r"cannot resume .*cut\.yaml: .*cut short"):
            open_store(cut, "resume")
        assert cut.read_text() == text[:end]


@pytest.mark.parametrize("text, message", [
    ("a: [1, 2", r"not valid YAML at line \d+"),
    ("- 1\n- 2\n", "expected a mapping at the top level, got list"),
    ("runs: 5\n", "kind: missing field"),
    ("kind: recall\n", "schema_version: missing field"),
    ("kind: bench\n", "schema_version: missing field"),
    ("kind: bench\nschema_version: 2\n", "points: missing field"),
    ("kind: recall\nschema_version: 1\nruns: 5\n", "runs: expected a list, got 5"),
    ("kind: recall\nschema_version: 1\nruns: [3]\n", r"runs\[0\]: expected a mapping"),
    ("kind: poetry\nschema_version: 1\n", "unknown results kind 'poetry'"),
    ("kind: bench\nschema_version: 2\npoints: []\ncomplete: true\nend_of_results: true\n",
     "settings: expected a mapping"),
    ("kind: bench\nschema_version: 2\nsettings: {}\npoints: []\nend_of_results: true\n",
     "complete: expected true or false"),
    ("kind: bench\nschema_version: 2\nsettings: {}\npoints: []\nend_of_results: true\n"
     "complete: true\n", "no completion marker"),
])
def test_structure_errors_name_the_problem(text, message):
    with pytest.raises(StoreError, match=message):
        parse_results(text)


def test_load_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("a: [1, 2")
    with pytest.raises(StoreError, match=r"^.*broken\.yaml: not valid YAML"):
        load(path)


def test_validate_runs_on_resume_and_before_every_write(tmp_path):
    path = written(tmp_path / "r.yaml", records(1))

    def validate(data):
        for record in data["points"]:
            if record.get("status") == "bad":
                raise ValueError(f"bad record {record['name']}")

    with open_store(path, "resume", validate=validate) as s:
        before = path.read_text()
        with pytest.raises(ValueError, match="bad record z"):
            s.add({"name": "z", "t": 0, "status": "bad"})
        assert path.read_text() == before  # nothing invalid reaches the file


def test_the_header_cannot_take_the_store_keys_or_an_old_schema(tmp_path):
    with pytest.raises(ValueError, match="store's keys"):
        open_store(tmp_path / "a.yaml", header={"schema_version": 2, "points": []})
    with pytest.raises(ValueError, match="schema_version must be an integer >= 2"):
        open_store(tmp_path / "b.yaml", header={"schema_version": 1})
    assert not list(tmp_path.iterdir())  # and the lock was released


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "r.yaml"
    s = open_store(path)
    s.add({"name": "a", "t": 0})
    before = path.read_text()

    def fail(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(store.os, "replace", fail)
    with pytest.raises(KeyboardInterrupt):
        s.add({"name": "a", "t": 1})
    monkeypatch.undo()
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml", "r.yaml.lock"]
    s.release()


def test_a_written_file_has_the_usual_permissions(tmp_path):
    path = tmp_path / "r.yaml"
    umask = os.umask(0o022)
    try:
        with open_store(path) as s:
            s.add({"name": "a", "t": 0})
        assert path.stat().st_mode & 0o777 == 0o644
        path.chmod(0o640)  # a replaced file keeps its own
        with open_store(path, "resume") as s:
            s.add({"name": "a", "t": 1})
        assert path.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(umask)


def test_a_value_used_twice_is_written_twice_without_anchors(tmp_path):
    shared = {"scale": 2}
    path = tmp_path / "r.yaml"
    with open_store(path) as s:
        s.update_header({"config": shared, "also": shared}, write=False)
        s.add({"name": "a", "t": 0, "options": shared})
    assert "&" not in path.read_text() and "*id" not in path.read_text()
    assert load(path)["points"][0]["options"] == {"scale": 2}


def test_temporary_names_are_unique_and_leftovers_are_removed(tmp_path, monkeypatch):
    path = tmp_path / "r.yaml"
    names = []
    mkstemp = store.tempfile.mkstemp
    monkeypatch.setattr(store.tempfile, "mkstemp",
                        lambda **kw: names.append(mkstemp(**kw)) or names[-1])
    with open_store(path) as s:
        for t in range(5):
            s.add({"name": "a", "t": t})
    temporaries = [name for _, name in names]
    assert len(set(temporaries)) == len(temporaries)
    assert all(Path(name).name.startswith(".r.yaml.") for name in temporaries)
    leftover = tmp_path / ".r.yaml.killed.tmp"  # as a writer killed mid-write leaves it
    leftover.write_text("kind: bench\nschema_ver")
    other = tmp_path / ".other.yaml.x.tmp"
    other.write_text("")
    open_store(path, "resume").release()
    assert not leftover.exists() and other.exists()


# ---------------------------------------------------------------- the lock


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    path = tmp_path / "r.yaml"
    first = open_store(path)
    lock = tmp_path / "r.yaml.lock"
    assert lock.read_text().split()[0] == str(os.getpid())
    for mode in store.MODES:
        with pytest.raises(LockedError, match=rf"r\.yaml is being written by pid {os.getpid()}"):
            open_store(path, mode)
    first.add({"name": "a", "t": 0})
    first.close()
    assert not lock.exists()
    with open_store(path, "resume") as again:
        assert again.kept == 1


def test_the_lock_is_released_when_the_block_raises(tmp_path):
    path = tmp_path / "r.yaml"
    with pytest.raises(RuntimeError):
        with open_store(path) as s:
            s.add({"name": "a", "t": 0})
            raise RuntimeError("stop")
    assert not (tmp_path / "r.yaml.lock").exists()
    data = load(path)
    assert data["complete"] is False and len(data["points"]) == 1
    open_store(path, "resume").release()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    path = written(tmp_path / "r.yaml", records(1))
    lock = tmp_path / "r.yaml.lock"
    dead = _dead_pid()
    lock.write_text(f"{dead} {os.uname().nodename}\n")
    with open_store(path, "resume") as s:
        assert lock.read_text().split()[0] == str(os.getpid()) and s.kept == 1
    assert not lock.exists()


def test_without_flock_a_live_pid_holds_the_lock_and_a_dead_one_does_not(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    path = tmp_path / "r.yaml"
    lock = tmp_path / "r.yaml.lock"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(f"{sleeper.pid} {os.uname().nodename}\n")
        with pytest.raises(LockedError, match=f"pid {sleeper.pid}"):
            open_store(path)
    finally:
        sleeper.kill()
        sleeper.wait()
    lock.write_text(f"{_dead_pid()} {os.uname().nodename}\n")
    with open_store(path) as s:
        s.add({"name": "a", "t": 0})
    assert not lock.exists()


HOLDER = textwrap.dedent("""
    import signal, sys, time
    from hla_bench.results.store import ResultsStore
    # a process started in the background inherits SIGINT ignored: take Python's own handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    s = ResultsStore.open(sys.argv[1], kind="bench", key=lambda r: r["t"], settings={},
                          mode="new", header={"schema_version": 2})
    with s:
        s.add({"t": 0})
        print("ready", flush=True)
        time.sleep(60)
""")


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, -signal.SIGINT)])
def test_the_lock_is_released_on_sigterm_and_sigint(tmp_path, sig, code):
    path = tmp_path / "r.yaml"
    env = {**os.environ, "PYTHONPATH": str(Path(store.__file__).parents[1])}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "ready\n", holder.stderr.read()
        with pytest.raises(LockedError, match=f"pid {holder.pid}"):
            open_store(path, "overwrite")
        holder.send_signal(sig)
        assert holder.wait(timeout=30) == code
    finally:
        holder.kill()
    assert not (tmp_path / "r.yaml.lock").exists()
    with ResultsStore.open(path, kind="bench", key=lambda r: r["t"], settings={},
                           mode="resume", header={"schema_version": 2}) as s:
        assert s.kept == 1


# ---------------------------------------------------------------- paths


def test_default_names_do_not_collide(tmp_path):
    names = {store.default_out_path("bench") for _ in range(200)}
    assert len(names) == 200
    name = next(iter(names))
    assert name.parent == Path("runs")
    assert re.fullmatch(rf"bench-\d{{8}}T\d{{6}}Z-{os.getpid()}-[0-9a-f]{{8}}\.yaml", name.name)
    assert store.default_out_path("recall", tmp_path).name.startswith("recall-")
    with pytest.raises(ValueError, match="unknown results kind"):
        store.default_out_path("poetry")


def test_runs_folder_is_ignored_by_git():
    ignored = (Path(__file__).parents[1] / ".gitignore").read_text().split()
    assert "/runs/" in ignored


def test_check_writable_names_the_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StoreError, match=r"out\.yaml: cannot write in"):
        store.check_writable(blocker / "sub" / "out.yaml")
    with pytest.raises(StoreError, match="is a folder"):
        store.check_writable(tmp_path)
    assert store.check_writable(tmp_path / "new" / "x.yaml") == tmp_path / "new" / "x.yaml"
    assert list((tmp_path / "new").iterdir()) == []
