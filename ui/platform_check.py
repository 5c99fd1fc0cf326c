"""Before the window opens: can Qt reach a screen on this machine?

On a minimal Linux, Qt's xcb platform plugin is present but some X libraries it links against are
not (`libxcb-icccm4`, `libxcb-keysyms1`, `libxcb-cursor0`, ...). Qt then aborts the process with
"Could not load the Qt platform plugin "xcb"", a message that names at most one of them and no
package. This module finds every missing library first (ldd on the plugin, as the loader sees it)
and says which packages to install. No Qt is imported here: it runs before QApplication exists.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

# shared object -> Debian / Ubuntu package (what Qt 6's xcb plugin and its libraries load)
DEBIAN_PACKAGES = {
    "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-image.so.0": "libxcb-image0",
    "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxcb-randr.so.0": "libxcb-randr0",
    "libxcb-render.so.0": "libxcb-render0",
    "libxcb-shape.so.0": "libxcb-shape0",
    "libxcb-shm.so.0": "libxcb-shm0",
    "libxcb-sync.so.1": "libxcb-sync1",
    "libxcb-xfixes.so.0": "libxcb-xfixes0",
    "libxcb-xinerama.so.0": "libxcb-xinerama0",
    "libxcb-xkb.so.1": "libxcb-xkb1",
    "libxcb-util.so.1": "libxcb-util1",
    "libxcb.so.1": "libxcb1",
    "libX11-xcb.so.1": "libx11-xcb1",
    "libX11.so.6": "libx11-6",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libxkbcommon.so.0": "libxkbcommon0",
    "libEGL.so.1": "libegl1",
    "libGL.so.1": "libgl1",
    "libOpenGL.so.0": "libopengl0",
    "libfontconfig.so.1": "libfontconfig1",
    "libfreetype.so.6": "libfreetype6",
    "libdbus-1.so.3": "libdbus-1-3",
    "libglib-2.0.so.0": "libglib2.0-0",
}
# Everything a fresh Debian 12 / Ubuntu 24.04 needs for the window (the README names it too).
ALL_PACKAGES = ("libxcb-cursor0", "libxcb-icccm4", "libxcb-keysyms1", "libxcb-image0",
                "libxcb-render-util0", "libxcb-randr0", "libxcb-shape0", "libxcb-xinerama0",
                "libxcb-xkb1", "libxkbcommon-x11-0", "libegl1", "libfontconfig1", "libdbus-1-3")


def xcb_plugin() -> Path | None:
    spec = importlib.util.find_spec("PySide6")
    if spec is None or spec.origin is None:
        return None
    plugin = Path(spec.origin).parent / "Qt" / "plugins" / "platforms" / "libqxcb.so"
    return plugin if plugin.exists() else None


def ldd_missing(path: Path) -> list[str]:
    """Shared objects `path` needs that the dynamic loader cannot find (ldd's "not found")."""
    ldd = shutil.which("ldd")
    if ldd is not None:
        out = subprocess.run([ldd, str(path)], capture_output=True, text=True, timeout=30).stdout
        names = [ln.split("=>")[0].strip() for ln in out.splitlines() if "not found" in ln]
        return list(dict.fromkeys(names))
    try:  # no ldd (musl, a stripped image): the loader names the first one it misses
        ctypes.CDLL(str(path))
    except OSError as exc:
        return [str(exc).split(":", 1)[0].strip()]
    return []


def platform_problem(
    env: Mapping[str, str] | None = None,
    missing_of: Callable[[Path], list[str]] = ldd_missing,
    plugin: Path | None = None,
    find_library: Callable[[str], str | None] = ctypes.util.find_library,
) -> str | None:
    """Why Qt would not open a window here, with what to do about it; None when it can (or when
    another platform than X11 is asked for: Qt's own messages cover those)."""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux"):
        return None
    platform = env.get("QT_QPA_PLATFORM", "")
    if platform and not platform.startswith("xcb"):
        return None
    if not env.get("DISPLAY"):
        if env.get("WAYLAND_DISPLAY") and not platform:
            return None  # Qt picks its Wayland plugin
        return ("no display: DISPLAY is not set. Start KVScope from a desktop session, under a "
                "virtual screen (`xvfb-run -a kvscope`), or without a window: "
                "`QT_QPA_PLATFORM=offscreen kvscope --screenshot shot.png`, `kvscope serve`, "
                "`kvscope chat`.")
    plugin = plugin or xcb_plugin()
    if plugin is None:
        return None
    missing = missing_of(plugin)
    # Qt 6.5+ loads libxcb-cursor at run time (no link-time dependency for ldd to see)
    if find_library("xcb-cursor") is None and "libxcb-cursor.so.0" not in missing:
        missing.append("libxcb-cursor.so.0")
    if not missing:
        return None
    packages = [DEBIAN_PACKAGES.get(name, name) for name in missing]
    return ("Qt's X11 platform plugin (xcb) cannot load: missing " + ", ".join(missing) + ".\n"
            "On Debian / Ubuntu: sudo apt install " + " ".join(dict.fromkeys(packages)) + "\n"
            "(everything the window needs: sudo apt install " + " ".join(ALL_PACKAGES) + ")")
