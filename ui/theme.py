"""Colours shared by every panel, and the dark Fusion palette the app uses."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtGui import QColor, QFont, QPalette
from PySide6.QtWidgets import QApplication

BG = "#1b1d23"  # plot and block-map background
PANEL = "#23262e"
TEXT = "#d7dae0"
MUTED = "#8a909c"
ACCENT = "#5aa9e6"

EMPTY = "#323642"
CACHED = "#5f7a99"  # free but holding a prefix hash: evictable, can be hit
SHARED = "#ffd23f"  # ref count > 1
FORK = "#f2f2f2"  # a branch's blocks shared with the branch it was forked from
# speculative decoding's last step, hatched over the blocks' own colours: slots that held drafts,
# and those whose rejected drafts' K/V was rolled back
SPEC_DRAFT = "#ffb000"
SPEC_ROLLBACK = "#ff2d55"
# one colour per live request (cycled); none of them close to CACHED or SHARED
REQUEST_COLOURS = [
    "#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6",
    "#bfef45", "#fabed4", "#469990", "#dcbeff", "#9a6324", "#aaffc3", "#ff7f7f",
    "#7f7fff", "#00a087",
]

SERIES = {
    "itl": "#42d4f4",
    "ttft": "#ff6b6b",
    "hit": "#ffd23f",
    "cached": CACHED,
    "computed": "#f58231",
    "prompt": "#f58231",
    "gen": "#3cb44b",
    "running": "#3cb44b",
    "waiting": "#e6194b",
    "in_use": "#4363d8",
    "occupancy": "#bfef45",
    "contiguous": "#f032e6",
}


def hex_rgb(h: str) -> tuple[int, int, int]:
    c = QColor(h)
    return c.red(), c.green(), c.blue()


def apply_dark_theme(app: QApplication) -> None:
    app.setStyle("Fusion")
    p = QPalette()
    base, window, text = QColor("#1e2027"), QColor(PANEL), QColor(TEXT)
    p.setColor(QPalette.ColorRole.Window, window)
    p.setColor(QPalette.ColorRole.WindowText, text)
    p.setColor(QPalette.ColorRole.Base, base)
    p.setColor(QPalette.ColorRole.AlternateBase, QColor("#262a33"))
    p.setColor(QPalette.ColorRole.ToolTipBase, QColor("#2b2f38"))
    p.setColor(QPalette.ColorRole.ToolTipText, text)
    p.setColor(QPalette.ColorRole.Text, text)
    p.setColor(QPalette.ColorRole.Button, QColor("#2b2f38"))
    p.setColor(QPalette.ColorRole.ButtonText, text)
    p.setColor(QPalette.ColorRole.BrightText, QColor("#ff6b6b"))
    p.setColor(QPalette.ColorRole.Highlight, QColor(ACCENT))
    p.setColor(QPalette.ColorRole.HighlightedText, QColor("#0d0e11"))
    p.setColor(QPalette.ColorRole.PlaceholderText, QColor(MUTED))
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText,
                 QPalette.ColorRole.WindowText):
        p.setColor(QPalette.ColorGroup.Disabled, role, QColor("#5c616c"))
    app.setPalette(p)
    app.setStyleSheet(
        "QToolTip { color: " + TEXT + "; background: #2b2f38; border: 1px solid #444a56; }"
        "QGroupBox { border: 1px solid #3a3f4b; border-radius: 4px; margin-top: 8px; }"
        "QGroupBox::title { subcontrol-origin: margin; left: 8px; padding: 0 3px; }"
    )
    pg.setConfigOptions(background=BG, foreground=TEXT, antialias=False)


def mono_font(size: int = 9) -> QFont:
    f = QFont("monospace")
    f.setStyleHint(QFont.StyleHint.TypeWriter)
    f.setPointSize(size)
    return f
