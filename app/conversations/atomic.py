"""Atomic JSON writes: a temp file beside the target, fsync'd, then renamed over it, so a crash
or a full disk never leaves half a file (the previous version stays whole)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json_atomic(path: Path, obj: object) -> None:
    """Write `obj` to `path`; on any OSError the old file is untouched and the error propagates."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def set_aside(path: Path) -> Path | None:
    """Rename an unreadable file to `<name>.bad`, out of the way of the next load but kept for
    the user to inspect. None if even that fails (read-only directory)."""
    bad = path.with_suffix(path.suffix + ".bad")
    try:
        path.rename(bad)
    except OSError:
        return None
    return bad
