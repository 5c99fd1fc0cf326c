"""The fused step's build lock (engine_proc/executor/build_lock.py, fused_build.locked_build): a
killed build leaves nothing that blocks the next start, a start waiting on a live build gets its
result when it finishes, and the PID lock (Windows) is stale once its owner is gone. Builds here
are cheap fakes, run in subprocesses as the engine's would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine_proc.executor import build_lock, fused_build

# A child that takes the lock in ``sys.argv[1]``'s build directory, says so, then builds a
# fake .so in ``sys.argv[2]`` seconds (or forever, to be killed).
CHILD = """
import sys, time
from pathlib import Path
from engine_proc.executor import fused_build

def build(directory: Path) -> None:
    print("building", flush=True)
    time.sleep(float(sys.argv[2]))
    (directory / "fake.so").write_text("built")

fused_build.locked_build(Path(sys.argv[1]), build)
"""


def _start_builder(directory: Path, seconds: float) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(fused_build.__file__).parents[2])}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(directory), str(seconds)],
                             stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    assert child.stdout is not None and child.stdout.readline() == "building\n"
    return child


def _lock(directory: Path) -> Path:
    return directory / fused_build.LOCK_NAME


@pytest.mark.slow
@pytest.mark.skipif(build_lock.fcntl is None, reason="flock: Linux and macOS")
def test_a_build_killed_midway_blocks_no_later_start(tmp_path):
    (tmp_path / "lock").touch()  # torch's lock, as an older build killed midway left it
    child = _start_builder(tmp_path, seconds=600)
    assert build_lock.held_elsewhere(_lock(tmp_path))
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    assert not build_lock.held_elsewhere(_lock(tmp_path))  # the OS dropped it with the process
    t0 = time.monotonic()
    result = fused_build.locked_build(tmp_path, lambda d: "built here")
    assert result == "built here" and time.monotonic() - t0 < 5  # at once, not after a timeout
    assert not (tmp_path / "lock").exists()  # torch's leftover lock removed: it would wait
    assert (tmp_path / fused_build.DONE_NAME).exists()


@pytest.mark.slow
def test_a_start_waiting_on_a_live_build_gets_its_result_when_it_finishes(tmp_path):
    child = _start_builder(tmp_path, seconds=2)
    assert build_lock.held_elsewhere(_lock(tmp_path))
    assert not (tmp_path / fused_build.DONE_NAME).exists()

    def load_or_build(directory: Path) -> str:
        return "loaded" if (directory / "fake.so").exists() else "built again"

    result: list[str] = []
    waiter = threading.Thread(
        target=lambda: result.append(fused_build.locked_build(tmp_path, load_or_build)))
    waiter.start()
    waiter.join(timeout=120)
    assert child.wait(timeout=30) == 0
    assert result == ["loaded"]  # it waited for the first build and used it
    assert (tmp_path / fused_build.DONE_NAME).exists()


def test_the_build_state_says_built_building_or_absent(tmp_path, monkeypatch):
    monkeypatch.setattr(fused_build, "build_dir", lambda key: tmp_path)
    monkeypatch.setattr(fused_build, "tokenizer_cache_dir", lambda: tmp_path / "tokenizers")
    assert fused_build.build_state() == "absent"
    lock = build_lock.make_lock(_lock(tmp_path))
    if build_lock.fcntl is not None:  # held by this process: another descriptor is blocked
        assert lock.acquire(blocking=False)
        assert _held_in_a_subprocess(_lock(tmp_path))
        lock.release()
    (tmp_path / "x.so").touch()
    assert fused_build.build_state() == "absent"  # a .so without the done mark: half-linked?
    (tmp_path / fused_build.DONE_NAME).touch()
    assert fused_build.build_state() == "built" and fused_build.is_built()


def _held_in_a_subprocess(path: Path) -> bool:
    code = ("import pathlib; from engine_proc.executor import build_lock as b; "
            f"print(b.held_elsewhere(pathlib.Path({str(path)!r})))")
    env = {**os.environ, "PYTHONPATH": str(Path(fused_build.__file__).parents[2])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    return out.stdout.strip() == "True"


def test_the_pid_lock_is_stale_once_its_owner_is_gone(tmp_path):
    path = tmp_path / "pid.lock"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert not build_lock.pid_alive(gone.pid) and build_lock.pid_alive(os.getpid())
    path.write_text(f"{gone.pid}\n")  # a build killed midway
    lock = build_lock.PidLock(path)
    assert lock.acquire(blocking=False)  # taken over at once
    assert path.read_text().strip() == str(os.getpid())
    other = build_lock.PidLock(path)
    assert not other.acquire(blocking=False)  # its owner (this process) is alive
    lock.release()
    assert not path.exists() and other.acquire(blocking=False)
    other.release()


def test_a_pid_lock_being_written_is_not_stale_until_its_writer_must_have_died(tmp_path):
    path = tmp_path / "pid.lock"
    path.write_text("")  # created, its PID not written yet
    lock = build_lock.PidLock(path, alive=lambda pid: False)
    assert not lock.remove_if_stale() and not lock.acquire(blocking=False)
    later = path.stat().st_mtime + build_lock.UNNAMED_STALE_SECONDS + 1
    assert lock.remove_if_stale(now=later) and not path.exists()
