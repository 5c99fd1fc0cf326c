"""Work around a PySide6 refcount bug on Python < 3.12.

PySide6 6.12 (built for Python 3.12+, where None is immortal, PEP 683) drops one reference to
None on every call of a void C++ method (`QTimer.setInterval`, `QPainter.drawPath`, ...) under
Python 3.11. A GUI makes thousands of such calls a second, so None's reference count (about 5,000
at start-up) reaches zero within seconds and the interpreter aborts with "none_dealloc: deallocating
None". We detect the leak and give None a reference count so large (2**60) that no session can
drain it, which is what Python 3.12 does for immortal objects anyway; True and False (which the
same builds also leak on some paths) get the same treatment.
"""

from __future__ import annotations

import ctypes
import sys

_BIG = 1 << 60
_patched = False


def none_refcount_leaks() -> bool:
    from PySide6.QtCore import QObject

    probe = QObject()
    before = sys.getrefcount(None)
    for _ in range(64):
        probe.setObjectName("probe")  # void method
    return sys.getrefcount(None) < before - 32


def patch_none_refcount() -> bool:
    """Make None effectively immortal if (and only if) this PySide6 leaks it. Idempotent."""
    global _patched
    if _patched or sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return _patched
    if none_refcount_leaks():
        # ob_refcnt is the first field of every PyObject in release builds of CPython 3.11
        # the same builds drop references to True and False on some paths (pyqtgraph's paint)
        for obj in (None, True, False):
            ctypes.c_ssize_t.from_address(id(obj)).value += _BIG
        _patched = True
    return _patched


_collector = None


def collect_garbage_on_gui_thread(interval_s: float = 1.0):
    """Collect Python's reference cycles on the GUI thread only, on a timer. Idempotent.

    The cycle collector runs in whichever thread happens to allocate when its thresholds trip:
    in this app, often the HTTP or ZeroMQ worker threads. When the garbage it finds holds Qt
    objects (a closed panel, a window's timers), PySide hands their deletion to the GUI thread
    to run at some later moment, and that crashed the process (SIGSEGV in ~QObject, called from
    shiboken's BindingManager::runDeletionInMainThread, in 1 of 3 runs of the fleet and remote
    tests) or hung it. pyqtgraph's GarbageCollector is the known fix: automatic collection off,
    `gc.collect` by generation thresholds on a GUI-thread QTimer.
    """
    global _collector
    if _collector is None:
        from pyqtgraph.util.garbage_collector import GarbageCollector

        _collector = GarbageCollector(interval=interval_s)
    return _collector
