"""The PySide6 refcount workaround: a GUI's worth of void calls must not crash the interpreter."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import sys
sys.path.insert(0, {root!r})
import ui  # applies the workaround
from PySide6.QtCore import QObject
o = QObject()
for _ in range(200_000):  # far more than None's natural reference count (~5,000)
    o.setObjectName("x")
print("alive", sys.getrefcount(None) > 1000)
"""


def test_many_void_calls_do_not_free_none():
    root = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=root)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "alive True" in out.stdout


GC_CHILD = """
import gc, sys, threading, time
sys.path.insert(0, {root!r})
import ui
from PySide6.QtCore import QObject
from PySide6.QtWidgets import QApplication
from ui.qt_compat import collect_garbage_on_gui_thread

app = QApplication([])
off_main = []
gc.callbacks.append(lambda phase, info: phase == "start"
                    and threading.current_thread() is not threading.main_thread()
                    and off_main.append(threading.current_thread().name))
collect_garbage_on_gui_thread(interval_s=0.05)
assert collect_garbage_on_gui_thread() is collect_garbage_on_gui_thread()  # one collector

class Holder(QObject):
    pass

def churn():  # a worker allocating cycles that hold Qt objects, as the HTTP workers do
    for _ in range(20_000):
        h = Holder()
        h.me = h
worker = threading.Thread(target=churn)
worker.start()
while worker.is_alive():
    app.processEvents()
    time.sleep(0.005)
end = time.monotonic() + 0.5
while time.monotonic() < end:
    app.processEvents()
    time.sleep(0.01)
print("enabled", gc.isenabled(), "off-main", len(off_main), "left", gc.get_count()[0])
"""


def test_cycles_are_collected_on_the_gui_thread_only():
    root = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", GC_CHILD.format(root=root)], capture_output=True,
                         text=True, timeout=120, env={**__import__("os").environ,
                                                      "QT_QPA_PLATFORM": "offscreen"})
    assert out.returncode == 0, out.stderr[-2000:]
    words = out.stdout.split()
    assert words[:4] == ["enabled", "False", "off-main", "0"], out.stdout
    assert int(words[5]) < 20_000  # the GUI thread's timer did collect the worker's cycles
