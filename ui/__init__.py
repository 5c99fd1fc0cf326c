"""Qt widgets of the KVScope desktop app (no torch, no engine_proc)."""

from ui.qt_compat import patch_none_refcount

patch_none_refcount()
