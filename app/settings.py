"""Where the GUI keeps its state: the data directory and QSettings.

`KVSCOPE_DATA_DIR` (or `--data-dir`) moves everything (conversations *and* settings, as an INI file)
into one directory, so tests and portable installs never touch the user's real profile.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QSettings, QStandardPaths

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


def load_sampling(s: QSettings) -> SamplingDefaults:
    d = SamplingDefaults()
    return SamplingDefaults(
        temperature=_num(s.value("sampling/temperature", d.temperature), float, d.temperature),
        top_p=_num(s.value("sampling/top_p", d.top_p), float, d.top_p),
        top_k=_num(s.value("sampling/top_k", d.top_k), int, d.top_k),
        max_tokens=_num(s.value("sampling/max_tokens", d.max_tokens), int, d.max_tokens),
        seed=_num(s.value("sampling/seed", d.seed), int, d.seed),
    )


def save_sampling(s: QSettings, p: SamplingDefaults) -> None:
    for name in ("temperature", "top_p", "top_k", "max_tokens", "seed"):
        s.setValue(f"sampling/{name}", getattr(p, name))


def _num(value: object, kind: type, default: float | int) -> float | int:
    # INI files hand everything back as strings
    try:
        return kind(float(value)) if kind is int else kind(value)
    except (TypeError, ValueError):
        return default
