"""Building the fused decode step's extension (engine_proc/fused_build.py): what a machine
lacks is named, and a killed build's lock does not block later starts. Compiling it is
exercised by every test using the `extension` fixture (tests/conftest.py)."""

from __future__ import annotations

from engine_proc import fused_build


def test_what_the_build_needs_is_named(monkeypatch):
    shutil = fused_build.shutil
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "ninja" else "/bin/x")
    assert fused_build.build_unavailable_reason() == "needs ninja on PATH (pip install ninja)"
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert "needs a C++ compiler" in fused_build.build_unavailable_reason()


def test_a_killed_builds_lock_is_removed_once_stale_and_a_live_one_is_kept(tmp_path):
    assert not fused_build.remove_stale_lock(tmp_path)  # no lock
    lock = tmp_path / "lock"
    lock.touch()
    mtime = lock.stat().st_mtime
    assert not fused_build.remove_stale_lock(tmp_path, now=mtime + 60)  # a build in progress
    assert lock.exists()
    assert fused_build.remove_stale_lock(tmp_path, now=mtime + fused_build.STALE_LOCK_SECONDS + 1)
    assert not lock.exists()
