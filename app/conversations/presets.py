"""System-prompt presets: named system prompts the user picks from for a conversation, kept in
one JSON file (`presets.json` in the data directory).

Until the user saves their own, the built-in ones are offered. A file that cannot be read is
set aside (renamed `.bad`) and logged, and the built-ins are offered again, so a bad file
never blocks the chat.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.conversations.atomic import set_aside, write_json_atomic
from app.conversations.model import DEFAULT_SYSTEM_PROMPT

log = logging.getLogger(__name__)

PRESETS_FILE = "presets.json"
PRESETS_VERSION = 1
MAX_NAME_CHARS = 80
CONCISE = (
    "You are a helpful assistant. Answer briefly and directly, without preamble; use a list "
    "only when it helps."
)
CODE_REVIEWER = (
    "You are an experienced code reviewer. Point out bugs, unclear names and missing tests "
    "first, then smaller style issues; quote the lines you mean and suggest a fix."
)


@dataclass(slots=True)
class Preset:
    name: str  # stripped; unique among the presets, ignoring case
    system_prompt: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"name must be a string, got {type(self.name).__name__}")
        self.name = self.name.strip()
        if not 1 <= len(self.name) <= MAX_NAME_CHARS:
            raise ValueError(f"name must be 1 to {MAX_NAME_CHARS} characters after stripping "
                             f"spaces, got {len(self.name)}")  # fmt: skip
        if not isinstance(self.system_prompt, str):
            raise ValueError(f"system_prompt must be a string, got {type(self.system_prompt)}")


def builtin_presets() -> list[Preset]:
    return [
        Preset("Helpful assistant", DEFAULT_SYSTEM_PROMPT),
        Preset("Concise", CONCISE),
        Preset("Code reviewer", CODE_REVIEWER),
    ]


def check_unique(presets: list[Preset]) -> None:
    seen: set[str] = set()
    for i, p in enumerate(presets):
        if p.name.casefold() in seen:
            raise ValueError(f"presets[{i}].name {p.name!r} is already used (names ignore case)")
        seen.add(p.name.casefold())


class PresetStore:
    """The presets in one JSON file: {"version": 1, "presets": [{name, system_prompt}, ...]}."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def load(self) -> list[Preset]:
        """The saved presets, or the built-in ones when none were saved or the file is bad."""
        if not self.path.exists():
            return builtin_presets()
        try:
            with open(self.path, encoding="utf-8") as f:
                return _parse(json.load(f))
        except (OSError, ValueError, RecursionError) as exc:
            log.warning("setting aside unreadable presets file %s: %s", self.path, exc)
            set_aside(self.path)
            return builtin_presets()

    def save(self, presets: list[Preset]) -> None:
        """Write atomically; ValueError (naming `name`) for duplicate names, OSError passes on."""
        check_unique(presets)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = [{"name": p.name, "system_prompt": p.system_prompt} for p in presets]
        write_json_atomic(self.path, {"version": PRESETS_VERSION, "presets": body})

    def get(self, name: str) -> Preset | None:
        key = name.strip().casefold()
        return next((p for p in self.load() if p.name.casefold() == key), None)

    def upsert(self, preset: Preset) -> list[Preset]:
        """Replace the preset of that name (ignoring case; it keeps its place) or add it at the
        end. Returns the presets as saved."""
        presets = self.load()
        key = preset.name.casefold()
        index = next((i for i, p in enumerate(presets) if p.name.casefold() == key), None)
        if index is None:
            presets.append(preset)
        else:
            presets[index] = preset
        self.save(presets)
        return presets

    def delete(self, name: str) -> bool:
        """Remove the preset of that name (ignoring case); False if there was none."""
        key = name.strip().casefold()
        presets = self.load()
        kept = [p for p in presets if p.name.casefold() != key]
        if len(kept) == len(presets):
            return False
        self.save(kept)
        return True


def _parse(d: Any) -> list[Preset]:
    if not isinstance(d, dict) or not isinstance(d.get("presets"), list):
        raise ValueError("presets file must be an object with a 'presets' list")
    version = d.get("version")
    if version != PRESETS_VERSION:
        raise ValueError(f"version must be {PRESETS_VERSION}, got {version!r}")
    presets = []
    for i, p in enumerate(d["presets"]):
        if not isinstance(p, dict):
            raise ValueError(f"presets[{i}] must be an object {{name, system_prompt}}")
        try:
            presets.append(Preset(p.get("name"), p.get("system_prompt")))
        except ValueError as exc:
            raise ValueError(f"presets[{i}].{exc}") from None
    check_unique(presets)
    return presets
