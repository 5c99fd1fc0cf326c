"""What the window remembers between runs (QSettings): its geometry and splitters, the load
panel's numbers, the chat's sampling and the open conversation."""

from __future__ import annotations

from app.settings import save_sampling
from ui.window.host import WindowHost


def restore_window_state(w: WindowHost) -> None:
    for key, box in w.load_panel.boxes().items():
        try:
            box.setValue(int(w.settings.value(f"load/{key}", box.value())))
        except (TypeError, ValueError):
            pass
    geo = w.settings.value("window/geometry")
    if geo is not None:
        w.restoreGeometry(geo)
    else:
        w.resize(1600, 1000)
    for key, split in (("window/main_split", w.main_split),
                       ("window/right_split", w.right_split)):  # fmt: skip
        state = w.settings.value(key)
        if state is not None:
            split.restoreState(state)


def save_window_state(w: WindowHost) -> None:
    w.settings.setValue("window/geometry", w.saveGeometry())
    w.settings.setValue("window/main_split", w.main_split.saveState())
    w.settings.setValue("window/right_split", w.right_split.saveState())
    save_sampling(w.settings, w.chat.sampling())
    for key, box in w.load_panel.boxes().items():
        w.settings.setValue(f"load/{key}", box.value())
    if w.chat.current is not None:
        w.settings.setValue("chat/current", w.chat.current.id)
    w.settings.sync()
