"""Building the fused decode step's extension (engine_proc/executor/fused_build.py): what a machine
lacks is named, torch's lock left by a killed build is removed (our own lock:
test_build_lock.py), and a cached build does not
recompile after the checkout moves. Compiling it is
exercised by every test using the `extension` fixture (tests/conftest.py)."""

from __future__ import annotations

import pytest

from engine_proc.executor import fused_build


def test_what_the_build_needs_is_named(monkeypatch):
    shutil = fused_build.shutil
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "ninja" else "/bin/x")
    assert fused_build.build_unavailable_reason() == "needs ninja on PATH (pip install ninja)"
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert "needs a C++ compiler" in fused_build.build_unavailable_reason()


def test_torchs_lock_left_by_a_killed_build_is_removed_under_ours(tmp_path):
    assert not fused_build.remove_leftover_torch_lock(tmp_path)  # no lock
    (tmp_path / "lock").touch()
    assert fused_build.locked_build(tmp_path, lambda d: (d / "lock").exists()) is False


def test_sources_are_staged_in_the_build_directory_once(tmp_path):
    sources = fused_build.read_sources()
    staged = fused_build.staged_sources(tmp_path, sources)
    names = sorted(p.name for p in fused_build.NATIVE.glob("*.[ch]*"))
    assert staged == tmp_path / "src" and sorted(p.name for p in staged.iterdir()) == names
    for name in names:
        assert (staged / name).read_bytes() == (fused_build.NATIVE / name).read_bytes()
    mtimes = {p.name: p.stat().st_mtime_ns for p in staged.iterdir()}
    edited = {**sources, fused_build.SOURCE.name: "// edited after the key was taken"}
    assert fused_build.staged_sources(tmp_path, edited) == staged  # a second start: untouched
    assert {p.name: p.stat().st_mtime_ns for p in staged.iterdir()} == mtimes
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # no staging folder left behind


def test_the_staged_sources_are_the_ones_the_key_was_taken_from(tmp_path):
    sources = {**fused_build.read_sources(), "common.h": "// the text that was hashed"}
    staged = fused_build.staged_sources(tmp_path, sources)
    assert (staged / "common.h").read_text() == "// the text that was hashed"
    assert fused_build.build_key(sources) != fused_build.build_key()


@pytest.mark.slow
def test_the_extension_is_compiled_from_the_staged_sources(extension):
    build = fused_build.build_dir(fused_build.build_key())
    ninja = (build / "build.ninja").read_text()
    assert str(build / "src" / fused_build.SOURCE.name) in ninja
    assert str(fused_build.SOURCE) not in ninja
