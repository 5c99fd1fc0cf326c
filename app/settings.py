"""Where the GUI keeps its state: the data directory and QSettings.

`KVSCOPE_DATA_DIR` (or `--data-dir`) moves everything (conversations *and* settings, as an INI file)
into one directory, so tests and portable installs never touch the user's real profile.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QSettings, QStandardPaths

log = logging.getLogger(__name__)

DATA_DIR_ENV = "KVSCOPE_DATA_DIR"
ORG = "KVScope"
APP = "KVScope"


def data_dir(override: str | os.PathLike | None = None) -> Path:
    """The app's data directory: the option, else the env var, else QStandardPaths."""
    chosen = override or os.environ.get(DATA_DIR_ENV)
    if chosen:
        path = Path(chosen).expanduser()
    else:
        loc = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.AppDataLocation)
        path = Path(loc) if loc else Path.home() / ".kvscope"
        if not loc or path.name in ("", "python", "python3"):
            path = path.parent / "KVScope"
    path.mkdir(parents=True, exist_ok=True)
    return path


def open_settings(override_dir: str | os.PathLike | None = None) -> QSettings:
    """QSettings in the data dir when one was forced, else the platform's native store."""
    chosen = override_dir or os.environ.get(DATA_DIR_ENV)
    if chosen:
        return QSettings(str(Path(chosen) / "settings.ini"), QSettings.Format.IniFormat)
    return QSettings(ORG, APP)


@dataclass(slots=True)
class SamplingDefaults:
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    max_tokens: int = 256
    seed: int = -1  # -1 = random

    def to_wire(self) -> dict:
        d: dict = {
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": int(self.top_k),
            "max_tokens": int(self.max_tokens),
        }
        if self.seed >= 0:
            d["seed"] = int(self.seed)
        return d


# name -> (type, lowest, highest) a remembered sampling value may take
SAMPLING_RANGES = {
    "temperature": (float, 0.0, 2.0),
    "top_p": (float, 1e-6, 1.0),
    "top_k": (int, 0, 1 << 20),
    "max_tokens": (int, 1, 1 << 20),
    "seed": (int, -1, 2**63 - 1),
}


def load_sampling(s: QSettings) -> SamplingDefaults:
    """The remembered sampling values; an unreadable file or value falls back to the default
    with a warning in the log (never a crash at start-up)."""
    if s.status() != QSettings.Status.NoError:
        log.warning("settings file %s is unreadable (%s); using defaults", s.fileName(),
                    s.status())  # fmt: skip
    d = SamplingDefaults()
    values = {}
    for name, (kind, low, high) in SAMPLING_RANGES.items():
        default = getattr(d, name)
        raw = s.value(f"sampling/{name}", default)
        value = _num(raw, kind, None)
        if value is None or not low <= value <= high:
            log.warning("settings: sampling/%s = %r is not valid; using %r", name, raw, default)
            value = default
        values[name] = value
    return SamplingDefaults(**values)


def save_sampling(s: QSettings, p: SamplingDefaults) -> None:
    for name in ("temperature", "top_p", "top_k", "max_tokens", "seed"):
        s.setValue(f"sampling/{name}", getattr(p, name))


def _num(value: object, kind: type, default: float | int | None) -> float | int | None:
    # INI files hand everything back as strings
    try:
        number = kind(float(value)) if kind is int else kind(value)
    except (TypeError, ValueError, OverflowError):
        return default
    return number if number == number else default  # NaN is no setting
