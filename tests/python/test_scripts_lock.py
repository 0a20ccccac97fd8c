"""The results-directory lock and the whole-or-nothing writes of scripts/attnbench_results.py,
which plot.py, anatomy.py and swap_eval.py write through (tests/scripts/scripts_lock_test.sh runs
them through plot.py itself). Needs no attnbench build."""
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts")
sys.path.insert(0, SCRIPTS)

import attnbench_results as ar  # noqa: E402

# Holds DIR's lock (results_lock), says "locked" on stdout, then waits to be killed.
HOLDER = f"""
import sys, time
sys.path.insert(0, {SCRIPTS!r})
from attnbench_results import results_lock
with results_lock(sys.argv[1], "holder"):
    print("locked", flush=True)
    time.sleep(60)
"""
# Holds flock on DIR/.attnbench.lock after writing `garbage` into it (no holder's line).
RAW_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.write(fd, b"garbage{")
print("locked", flush=True)
time.sleep(60)
"""


def start(code, *args):
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def stop(p):
    p.send_signal(signal.SIGKILL)
    p.wait()


def test_the_holder_writes_its_line(tmp_path):
    d = str(tmp_path / "r")
    with ar.results_lock(d, "prog") as path:
        assert path == os.path.join(d, ".attnbench.lock")
        with open(path) as f:
            text = f.read()
        assert text.endswith("\n") and text.count("\n") == 1
        info = json.loads(text)
        assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
        assert info["command"] == " ".join(sys.argv)
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", info["started"])
    assert os.path.isfile(path), "the lock file is never deleted"
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o644 & ~_umask())


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_second_writer_is_refused_naming_the_first(tmp_path):
    d = str(tmp_path)
    holder = start(HOLDER, d, "--out", "X")
    try:
        with pytest.raises(ar.ResultsError) as e:
            with ar.results_lock(d, "prog"):
                pytest.fail("took a lock another process holds")
        msg = str(e.value)
        assert msg.startswith(f"results directory '{d}' is being written by another process "
                              f"(pid {holder.pid} on {socket.gethostname()}, started ")
        assert f": -c {d} --out X); wait for it to finish or write elsewhere" in msg
        # the refused writer left the holder's line as it was
        with open(os.path.join(d, ".attnbench.lock")) as f:
            assert json.load(f)["pid"] == holder.pid
    finally:
        stop(holder)
    # the kernel released the lock of the killed holder
    with ar.results_lock(d, "prog"):
        with open(os.path.join(d, ".attnbench.lock")) as f:
            assert json.load(f)["pid"] == os.getpid()


def test_an_unreadable_holder_is_still_refused(tmp_path):
    holder = start(RAW_HOLDER, str(tmp_path / ".attnbench.lock"))
    try:
        start_s = time.monotonic()
        with pytest.raises(ar.ResultsError, match=r"being written by another process \(an "
                                                  r"unknown process\); wait for it"):
            with ar.results_lock(str(tmp_path), "prog"):
                pass
        assert time.monotonic() - start_s < 5
    finally:
        stop(holder)


def test_the_lock_is_not_inherited_by_children(tmp_path):
    d = str(tmp_path)
    with ar.results_lock(d, "prog"):
        child = subprocess.Popen(["sleep", "30"])
    try:
        with ar.results_lock(d, "prog"):  # the child of the first holder does not hold it
            pass
    finally:
        child.kill()
        child.wait()


def test_without_create_a_missing_directory_is_the_usual_error(tmp_path):
    d = str(tmp_path / "missing")
    with pytest.raises(ar.ResultsError, match="is not a directory; expected a results "
                                              "directory"):
        with ar.results_lock(d, "prog", create=False):
            pass
    assert not os.path.exists(d)


def test_atomic_write_replaces_the_file_whole(tmp_path):
    p = str(tmp_path / "report.md")
    ar.atomic_write_text(p, "old\n")
    ar.atomic_write_text(p, "new ü\n")
    with open(p, encoding="utf-8") as f:
        assert f.read() == "new ü\n"
    ar.atomic_write_bytes(p, b"\x89PNG")
    ar.atomic_write_json(str(tmp_path / "a.json"), {"k": [1, 2]}, indent=1)
    with open(tmp_path / "a.json") as f:
        assert json.load(f) == {"k": [1, 2]}
    assert sorted(os.listdir(tmp_path)) == ["a.json", "report.md"]  # no temporary file left


def _fail_fsync(monkeypatch, code=errno.ENOSPC):
    real = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
            raise OSError(code, os.strerror(code))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("how", ["fsync", "write"])
def test_a_full_disk_leaves_the_previous_file(tmp_path, monkeypatch, how):
    p = str(tmp_path / "report.md")
    ar.atomic_write_text(p, "previous\n")
    if how == "fsync":
        _fail_fsync(monkeypatch)
        write = lambda f: f.write("x" * 100)  # noqa: E731
    else:
        def write(f):
            f.write("partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with pytest.raises(ar.ResultsError) as e:
        ar.atomic_write(p, write, binary=False)
    assert str(e.value) == (f"cannot write '{p}': No space left on device; the previous file "
                            f"is left as it was")
    with open(p) as f:
        assert f.read() == "previous\n"
    assert os.listdir(tmp_path) == ["report.md"]


def test_a_failed_first_write_leaves_no_file(tmp_path, monkeypatch):
    _fail_fsync(monkeypatch, errno.EIO)
    p = str(tmp_path / "x.png")
    with pytest.raises(ar.ResultsError, match=r"cannot write '.*x\.png': Input/output error; "
                                              r"no file was written"):
        ar.atomic_write_bytes(p, b"data")
    assert os.listdir(tmp_path) == []


def test_another_exception_propagates_and_leaves_the_previous_file(tmp_path):
    p = str(tmp_path / "f.csv")
    ar.atomic_write_text(p, "a\n")

    def write(f):
        f.write("b")
        raise ValueError("drawing failed")

    with pytest.raises(ValueError, match="drawing failed"):
        ar.atomic_write(p, write, binary=False)
    with open(p) as f:
        assert f.read() == "a\n"
    assert os.listdir(tmp_path) == ["f.csv"]


def test_a_device_is_written_in_place():
    ar.atomic_write_text(os.devnull, "nothing")
    assert os.path.exists(os.devnull) and not os.path.isfile(os.devnull)


def test_a_real_full_file_system(tmp_path):
    """On a 64 KiB tmpfs (root only; skipped where it cannot be mounted)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", f"tmpfs-{uuid.uuid4().hex}",
                          str(mnt)], capture_output=True)
    if run.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    try:
        p = str(mnt / "report.md")
        ar.atomic_write_text(p, "previous\n")
        with pytest.raises(ar.ResultsError, match=f"cannot write '{re.escape(p)}': No space "
                                                  f"left on device; the previous file is left"):
            ar.atomic_write_bytes(p, b"x" * (1 << 20))
        with open(p) as f:
            assert f.read() == "previous\n"
        assert os.listdir(mnt) == ["report.md"]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
