"""A lock owned by a live process, for building the fused decode step once per machine.

On Linux and macOS it is an ``fcntl.flock`` on a lock file: the OS drops it when its process
exits or is killed, so a build stopped midway never blocks a later start (torch's own lock is
a file whose existence is the lock, left behind by a killed build). Windows has no fcntl: there
the lock file is created exclusively and holds its owner's PID, and a lock whose PID is gone is
stale and taken over. What uses it: engine_proc/executor/fused_build.py."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Protocol

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.2  # between tries of a lock held elsewhere (a build takes about a minute)
# A PID lock file naming no PID this long after it was created: its writer died before
# writing its PID (it writes it right after creating the file)
UNNAMED_STALE_SECONDS = 10.0


class BuildLock(Protocol):
    def acquire(self, blocking: bool = True) -> bool: ...
    def release(self) -> None: ...


class FlockLock:
    """``fcntl.flock`` on ``path``, released by the OS with its process. The file itself stays:
    removing it while another process waits on it would let a third lock a new file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None

    def acquire(self, blocking: bool = True) -> bool:
        assert fcntl is not None
        file = open(self.path, "a+")  # noqa: SIM115 - held open for as long as the lock is
        flags = fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB)
        try:
            fcntl.flock(file.fileno(), flags)
        except BlockingIOError:
            file.close()
            return False
        file.truncate(0)  # the owner's PID, for a person looking at the cache
        file.write(f"{os.getpid()}\n")
        file.flush()
        self._file = file
        return True

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor drops the flock
            self._file = None


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (on Windows without signalling it: os.kill kills there)."""
    if pid <= 0:
        return False
    if sys.platform == "win32":
        return _windows_pid_alive(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _windows_pid_alive(pid: int) -> bool:
    import ctypes

    kernel32 = ctypes.windll.kernel32  # type: ignore[attr-defined]
    handle = kernel32.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
    if not handle:
        return False
    code = ctypes.c_ulong()
    try:
        ok = kernel32.GetExitCodeProcess(handle, ctypes.byref(code))
        return bool(ok) and code.value == 259  # STILL_ACTIVE
    finally:
        kernel32.CloseHandle(handle)


class PidLock:
    """The lock file exists while held and names its owner's PID; stale once that PID is gone
    (where fcntl is missing). ``alive`` is injectable for tests."""

    def __init__(self, path: Path, alive: Callable[[int], bool] = pid_alive) -> None:
        self.path = path
        self.alive = alive
        self._held = False

    def acquire(self, blocking: bool = True) -> bool:
        while True:
            if self._try_create():
                return True
            self.remove_if_stale()
            if not blocking:
                return self._try_create()
            time.sleep(POLL_SECONDS)

    def _try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        self._held = True
        return True

    def owner(self) -> int | None:
        """The PID in the lock file; None when there is no lock file, 0 when it names none
        (its writer between creating it and writing its PID, or killed there)."""
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            return None
        return int(text) if text.isdigit() else 0

    def remove_if_stale(self, now: float | None = None) -> bool:
        """Remove the lock file when its owner is gone (True when it was)."""
        pid = self.owner()
        if pid is None or (pid != 0 and self.alive(pid)):
            return False
        if pid == 0 and not self._unnamed_too_long(now):
            return False
        logger.warning("removing a build lock of a process that is gone (PID %d): %s", pid,
                       self.path)  # fmt: skip
        self.path.unlink(missing_ok=True)
        return True

    def _unnamed_too_long(self, now: float | None) -> bool:
        try:
            age = (time.time() if now is None else now) - self.path.stat().st_mtime
        except FileNotFoundError:
            return False
        return age > UNNAMED_STALE_SECONDS

    def release(self) -> None:
        if self._held:
            self.path.unlink(missing_ok=True)
            self._held = False


def make_lock(path: Path) -> BuildLock:
    return FlockLock(path) if fcntl is not None else PidLock(path)


def held_elsewhere(path: Path) -> bool:
    """Whether another live process holds the lock at ``path`` now (a build in progress)."""
    lock = make_lock(path)
    if lock.acquire(blocking=False):
        lock.release()
        return False
    return True


@contextlib.contextmanager
def holding(path: Path) -> Iterator[None]:
    """Hold the lock at ``path`` (waiting for a live holder to finish) for the block."""
    lock = make_lock(path)
    if not lock.acquire(blocking=False):
        logger.info("another process is building the fused decode step; waiting for it")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
