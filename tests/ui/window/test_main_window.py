"""The whole window against a real engine process (tiny random model, one process per module):
streaming, Stop, live controls, the block map during and after generation, engine death and
Restart."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ipc.client import EngineClient
from tests.ui.conftest import window_on_tiny_engine
from ui.kv import block_map as bm
from ui.kv.prefix_tree import SELECTED_BAR
from ui.telemetry import BLOCK_CACHED, BLOCK_IN_USE
from ui.window.main_window import MainWindow

pytestmark = pytest.mark.slow
ENGINE_ARGS = ("--num-kv-blocks", "64", "--max-model-len", "512")


@pytest.fixture(scope="module")
def win(qapp, tmp_path_factory):
    with window_on_tiny_engine(tmp_path_factory.mktemp("kvscope-data"), *ENGINE_ARGS,
                               show=True) as w:
        yield w


def _greedy(win: MainWindow, max_tokens: int) -> None:
    win.chat.temperature.setValue(0.0)
    win.chat.max_tokens.setValue(max_tokens)
    win.chat.seed.setValue(-1)


def _send(win: MainWindow, text: str) -> str:
    win.chat.new_conversation()
    win.chat.input.setPlainText(text)
    rid = win.chat.send_current()
    assert rid is not None
    return rid


def test_chat_streams_into_the_panel(win, qtbot):
    _greedy(win, 24)
    seen: list[str] = []
    win.link.replies.connect(lambda msgs: seen.extend(type(m).__name__ for m in msgs))
    _send(win, "Tell me about blocks.")
    conv = win.chat.current
    reply = conv.messages[-1]
    # the test's slot is a second receiver of the same batches, delivered after the panel's:
    # wait for it too, or the panel may have the Finish while `seen` does not yet
    qtbot.waitUntil(lambda: not win.chat.busy(conv.id) and "Finish" in seen, timeout=60_000)
    assert seen.count("Delta") >= 2 and seen[-1] == "Finish"  # streamed, not one blob
    assert reply.stats["completion_tokens"] == 24 and reply.stats["finish_reason"] == "length"
    assert reply.stats["prompt_tokens"] > 0 and reply.stats["ttft"] > 0
    view = win.chat._view_for(reply)
    assert view.text.text() == reply.content and "TTFT" in view.stats.text()
    # independent reference: the same greedy chat through a separate protocol client
    with EngineClient(win.supervisor.ready_info["endpoint"]) as client:
        ref = client.chat(conv.to_prompt()[:-1], max_tokens=24, temperature=0.0).result(60)
    assert reply.content == ref.text


def test_stop_ends_the_reply(win, qtbot):
    _greedy(win, 400)
    _send(win, "Count to a thousand.")
    conv = win.chat.current
    reply = conv.messages[-1]
    qtbot.waitUntil(lambda: len(reply.content) > 0, timeout=60_000)
    qtbot.mouseClick(win.chat.stop_btn, _left())
    qtbot.waitUntil(lambda: not win.chat.busy(conv.id), timeout=30_000)
    assert reply.interrupted and reply.stats["finish_reason"] == "abort"
    assert 0 < reply.stats["completion_tokens"] < 400
    assert win.chat.send_btn.isEnabled()


def test_slider_change_reaches_the_engine(win, qtbot):
    win.controls.set_limit("max_num_seqs", 7)
    win.controls.set_limit("long_prefill_chunk", 64)
    qtbot.waitUntil(lambda: win.history.latest.config.get("max_num_seqs") == 7
                    and win.history.latest.config.get("long_prefill_chunk") == 64,
                    timeout=30_000)
    assert win.controls.values["max_num_seqs"].text() == "7"
    assert not win.controls.auto_chunk.isChecked()  # a number of the slider's
    win.controls.auto_chunk.click()  # back to the engine's rule
    qtbot.waitUntil(lambda: win.history.latest.config.get("long_prefill_chunk_default") is True,
                    timeout=30_000)
    assert win.history.latest.config["long_prefill_chunk"] == 512  # beside other requests
    assert win.controls.auto_chunk.isChecked() and win.controls.values[
        "long_prefill_chunk"].text() == "512"
    win.controls.set_limit("long_prefill_chunk", 128)  # moving the slider leaves the rule
    assert not win.controls.auto_chunk.isChecked()
    qtbot.waitUntil(lambda: win.history.latest.config.get("long_prefill_chunk") == 128
                    and not win.history.latest.config.get("long_prefill_chunk_default"),
                    timeout=30_000)
    win.controls.prefix.click()  # off
    qtbot.waitUntil(lambda: win.history.latest.config.get("enable_prefix_caching") is False,
                    timeout=30_000)
    win.controls.prefix.click()  # on again
    qtbot.waitUntil(lambda: win.history.latest.config.get("enable_prefix_caching") is True,
                    timeout=30_000)


def test_block_map_in_use_then_cached(win, qtbot):
    _greedy(win, 160)
    rid = _send(win, "A long answer please, about the weather in many cities.")
    conv = win.chat.current

    def in_use_drawn() -> bool:
        f = win.block_map.frame
        req = f and next((r for r in f.requests if r.request_id == rid), None)
        if req is None or not req.block_table:
            return False
        win.block_map.redraw()
        idx = win.block_map.colour_index
        return all(f.state[b] == BLOCK_IN_USE for b in req.block_table) and all(
            bm.REQ0 <= idx[b] < bm.REQ0 + bm.NREQ or idx[b] == bm.SHARED
            for b in req.block_table)

    def running() -> bool:
        f = win.block_map.frame
        return bool(f) and any(r.request_id == rid and r.block_table for r in f.requests)

    # Seen running once, the engine is paused so the request stays in flight while the map
    # draws it (a fast machine finished it between two frames once).
    qtbot.waitUntil(running, timeout=60_000)
    win.link.control("pause")
    try:
        qtbot.waitUntil(in_use_drawn, timeout=60_000)
        # the conversation is selected, so its request is highlighted with its block table
        assert win.block_map.highlight_rid == rid
        assert "logical→physical" in win.block_map.block_table.toPlainText()
    finally:
        win.link.control("resume")
    qtbot.waitUntil(lambda: not win.chat.busy(conv.id), timeout=60_000)
    table, hashes = None, None

    def cached_drawn() -> bool:
        nonlocal table, hashes
        f = win.history.latest
        if any(r.request_id == rid for r in f.requests):
            return False
        table, hashes = win.history.last_tables[rid]
        full = [b for b, h in zip(table, hashes, strict=True) if h]
        win.block_map.redraw(force=True)
        idx = win.block_map.colour_index
        return bool(full) and all(f.state[b] == BLOCK_CACHED and idx[b] == bm.CACHED
                                  for b in full)

    qtbot.waitUntil(cached_drawn, timeout=30_000)
    f = win.history.latest
    assert np.count_nonzero(f.state == BLOCK_IN_USE) == 0


def test_prefix_tree_tab_draws_the_conversation_from_kv_events(win, qtbot):
    """The engine's KV cache events reach the window's worker, which lays the tree out while
    the tab is shown; the panel draws the chat's full blocks, highlighted (it is selected)."""
    win.kv_tabs.setCurrentWidget(win.prefix_tree)
    try:
        assert win.link.tree.wanted
        _greedy(win, 160)
        rid = _send(win, "Prefix trees grow from shared system prompts, branch by branch.")

        def running_req():
            f = win.prefix_tree.frame
            return f and next((r for r in f.requests if r.request_id == rid), None)

        def has_full_block() -> bool:
            req = running_req()
            return req is not None and req.num_computed_tokens >= win.prefix_tree.frame.block_size

        qtbot.waitUntil(has_full_block, timeout=60_000)
        win.link.control("pause")  # keep the request in flight however slow the machine is
        try:

            def drawn() -> bool:
                lay, f, req = win.prefix_tree.layout_, win.prefix_tree.frame, running_req()
                if lay is None or req is None:
                    return False
                full = req.block_table[: req.num_computed_tokens // f.block_size]
                if not (full and set(full) <= set(lay.block_id.tolist())):
                    return False
                win.prefix_tree.redraw(force=True)
                return SELECTED_BAR in win.prefix_tree.kind  # selected conversation: highlighted

            qtbot.waitUntil(drawn, timeout=60_000)
            assert win.prefix_tree.highlight_rid == rid
            assert "cached blocks" in win.prefix_tree.note.text()
        finally:
            win.link.control("resume")
        qtbot.waitUntil(lambda: not win.chat.busy(win.chat.current.id), timeout=60_000)

        def all_full_blocks_in_tree() -> bool:
            table, hashes = win.history.last_tables.get(rid, ([], []))
            full = [b for b, h in zip(table, hashes, strict=True) if h]
            lay = win.prefix_tree.layout_
            return bool(full) and set(full) <= set(lay.block_id.tolist())

        qtbot.waitUntil(all_full_blocks_in_tree, timeout=30_000)
    finally:
        win.kv_tabs.setCurrentWidget(win.block_map)
    assert not win.link.tree.wanted


def test_engine_death_then_restart(win, qtbot):
    _greedy(win, 400)
    _send(win, "Keep talking.")
    conv = win.chat.current
    reply = conv.messages[-1]
    qtbot.waitUntil(lambda: len(reply.content) > 0, timeout=60_000)
    win.supervisor.kill()
    qtbot.waitUntil(lambda: win.state == "disconnected", timeout=30_000)
    assert win.banner.isVisible() and "exited" in win.banner.text.text()
    assert "[engine exited with code" in win.banner.log.toPlainText()
    assert reply.interrupted and reply.content  # text kept, marked
    assert not win.chat.send_btn.isEnabled() and win.banner.restart_btn.isEnabled()
    # nothing typed is lost: the user's turn and the partial reply are on disk
    saved = {c.id: c for c in win.chat.store.load_all()}[conv.id]
    assert saved.messages[-2].content == "Keep talking."
    assert saved.messages[-1].interrupted and saved.messages[-1].content == reply.content
    # still responsive: typing works while the engine is down
    win.chat.input.setPlainText("typed while down")
    qtbot.wait(50)
    qtbot.mouseClick(win.banner.restart_btn, _left())
    qtbot.waitUntil(lambda: win.state in ("ready", "busy"), timeout=180_000)
    assert not win.banner.isVisible()
    _greedy(win, 8)
    _send(win, "Back?")
    conv2 = win.chat.current
    qtbot.waitUntil(lambda: not win.chat.busy(conv2.id), timeout=60_000)
    assert conv2.messages[-1].stats["completion_tokens"] == 8


def _left():
    from PySide6.QtCore import Qt

    return Qt.MouseButton.LeftButton


def test_decode_weights_menu_restarts_the_engine_with_int4(win, qtbot, monkeypatch):
    assert win.decode_weight_actions["dense"].isChecked()
    # A reply in progress: the restart is asked about first; "no" leaves everything as it was.
    _greedy(win, 400)
    _send(win, "Keep going.")
    conv = win.chat.current
    qtbot.waitUntil(lambda: len(conv.messages[-1].content) > 0, timeout=60_000)
    asked: list[int] = []
    monkeypatch.setattr(win, "confirm_restart", lambda n, what: asked.append(n) or False)
    before = win.welcome
    win.decode_weight_actions["int4"].trigger()
    assert asked == [1] and win.decode_weight_actions["dense"].isChecked()
    assert win.welcome is before and win.chat.busy(conv.id)
    win.chat.stop_current()
    qtbot.waitUntil(lambda: not win.chat.active, timeout=60_000)
    win.decode_weight_actions["int4"].trigger()
    qtbot.waitUntil(lambda: win.welcome is not None and win.state in ("ready", "busy")
                    and win.welcome.model.decode_weights == "int4", timeout=180_000)
    assert "int4 decode weights" in win.model_label.text()
    assert win.settings.value("engine/decode_weights") == "int4"
    _greedy(win, 6)
    _send(win, "Quick?")
    conv = win.chat.current
    qtbot.waitUntil(lambda: not win.chat.busy(conv.id), timeout=60_000)
    assert conv.messages[-1].stats["completion_tokens"] == 6
    win.set_decode_weights("dense")  # back, for whatever runs next in this module
    qtbot.waitUntil(lambda: win.welcome is not None and win.state in ("ready", "busy")
                    and win.welcome.model.decode_weights == "dense", timeout=180_000)
    assert win.decode_weight_actions["dense"].isChecked()
    with pytest.raises(ValueError, match="decode weights must be one of"):
        win.set_decode_weights("int3")


def test_an_edited_branch_takes_the_shared_history_from_the_prefix_cache(win, qtbot):
    """Edit → send: the new branch's prompt-cache hit is the shared history's full blocks,
    counted with the model's own tokenizer and chat template (transformers), and the block map
    marks exactly those blocks as shared with the branch it forked from."""
    from transformers import AutoTokenizer

    from tests.tiny_models import tiny_model_dir

    _greedy(win, 6)
    _send(win, "Tell me about paged attention and its blocks of keys and values.")
    conv = win.chat.current
    qtbot.waitUntil(lambda: not win.chat.busy(conv.id), timeout=60_000)
    win.chat.input.setPlainText("And what does prefix caching add to that?")
    old_rid = win.chat.send_current()
    old_prompt = conv.to_prompt()  # the history the old reply answers (it is empty so far)
    qtbot.waitUntil(lambda: not win.chat.busy(conv.id), timeout=60_000)
    forks: list = []
    win.chat.branch_sent.connect(lambda rid, src: forks.append((rid, src)))
    win.chat.start_edit(conv.messages[2])
    _greedy(win, 48)  # long enough to be seen running: the map notes its hit blocks live
    win.chat.input.setPlainText("And what does chunked prefill change?")
    rid = win.chat.send_current()
    new_prompt = conv.to_prompt()
    assert forks == [(rid, old_rid)]
    reply = conv.messages[-1]

    def marked() -> bool:
        win.block_map.redraw(force=True)
        return bool(win.block_map.fork_blocks)

    qtbot.waitUntil(marked, timeout=60_000)
    qtbot.waitUntil(lambda: not win.chat.busy(conv.id), timeout=60_000)

    tok = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    old_ids, new_ids = (
        tok(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False).input_ids for p in (old_prompt, new_prompt))
    shared = next(i for i, (a, b) in enumerate(zip(old_ids, new_ids, strict=False)) if a != b)
    bs = win.welcome.model.block_size
    assert shared >= 2 * bs  # the test means something: whole blocks of history are shared
    assert reply.stats["prompt_tokens"] == len(new_ids)
    assert reply.stats["cached_tokens"] == shared // bs * bs
    win.block_map.redraw(force=True)
    assert win.block_map.highlight_rid == rid
    assert len(win.block_map.fork_blocks) * bs == reply.stats["cached_tokens"]
    assert "reused from the earlier branch" in win.chat._view_for(reply).stats.text()


def _greedy_reply(win: MainWindow, qtbot, prompt: str, max_tokens: int):
    """A new conversation's greedy reply to prompt, finished; the conversation."""
    _greedy(win, max_tokens)
    _send(win, prompt)
    conv = win.chat.current
    qtbot.waitUntil(lambda: not win.chat.busy(conv.id), timeout=60_000)
    return conv


def _restarted(win: MainWindow, qtbot, speculative: bool) -> None:
    """Wait for the engine restarted with (or without) a --speculative-config to be ready."""
    qtbot.waitUntil(lambda: win.welcome is not None and win.state in ("ready", "busy")
                    and ("--speculative-config" in win.supervisor.command) == speculative,
                    timeout=180_000)  # fmt: skip


def test_speculative_decoding_menu_restarts_the_engine_and_replies_stay_the_same(win, qtbot):
    """*Engine → Speculative decoding → n-gram, 4*: the engine restarts with vLLM's
    --speculative-config, and a greedy reply is the one it gave without speculation (exact)."""
    from ui.window.status_bar import spec_counters_text

    assert win.spec_actions[0].isChecked()
    _greedy(win, 160)
    prompt = "one two three one two three one two three one two three"
    _send(win, prompt)
    plain = win.chat.current
    qtbot.waitUntil(lambda: not win.chat.busy(plain.id), timeout=60_000)
    win.spec_actions[4].trigger()
    _restarted(win, qtbot, speculative=True)
    i = win.supervisor.command.index("--speculative-config")
    assert json.loads(win.supervisor.command[i + 1]) == {"method": "ngram",
                                                         "num_speculative_tokens": 4}
    assert win.settings.value("engine/speculative_tokens") in (4, "4")
    spec = _greedy_reply(win, qtbot, prompt, 160)
    assert spec.messages[-1].content == plain.messages[-1].content
    # the tiny model's greedy reply repeats itself once in 160 tokens: a draft was proposed
    # (the engine's snapshot after the reply's end can come a frame later)
    qtbot.waitUntil(lambda: win.history.latest.counters.get("spec_decode_num_draft_tokens", 0)
                    > 0, timeout=10_000)  # fmt: skip
    assert "spec_decode_num_drafts" in win.history.latest.counters  # vLLM's names
    qtbot.waitUntil(lambda: win.status.tiers_label.text().startswith("speculation: "))
    assert win.status.tiers_label.text() == spec_counters_text(win.history.latest.counters)
    # the reply's own counts (its Finish) against the engine's aggregate counters, which since
    # the restart count this one request alone: counted apart, they must agree
    stats = spec.messages[-1].stats
    qtbot.waitUntil(lambda: win.history.latest.counters["spec_decode_num_draft_tokens"]
                    == stats.get("draft_tokens"), timeout=10_000)  # fmt: skip
    counters = win.history.latest.counters
    accepted = counters["spec_decode_num_accepted_tokens"]
    assert stats["accepted_draft_tokens"] == accepted
    drafted = stats["draft_tokens"]
    assert (f"drafts {accepted:.0f}/{drafted} accepted ({accepted / drafted:.0%})"
            in win.chat._view_for(spec.messages[-1]).stats.text())
    win.charts.refresh(win.history)
    assert not win.charts.spec.isHidden()  # the chart shows while the engine speculates
    assert win.charts.spec.bars.opts["height"][0] == counters[
        "spec_decode_num_accepted_tokens_per_pos:0"]
    win.set_speculative_tokens(0)  # back, for whatever runs next in this module
    _restarted(win, qtbot, speculative=False)
    qtbot.waitUntil(lambda: win.history.latest is not None
                    and "spec_decode_num_drafts" not in win.history.latest.counters)
    win.charts.refresh(win.history)
    assert win.charts.spec.isHidden()
    with pytest.raises(ValueError, match="speculative tokens must be one of"):
        win.set_speculative_tokens(3)


def test_a_draft_model_from_the_menu_proposes_and_replies_stay_the_same(win, qtbot, tmp_path):
    """*Speculative decoding → Draft model…*: the Models dialog picks the draft (its button says
    so), the engine restarts with vLLM's {"model": PATH, ...}, a greedy reply is the plain one,
    and the draft (a copy of the chat model: same tokenizer; the draft engine runs it with
    4-bit weights where it can, so a near-tie may fall the other way) has most accepted."""
    import subprocess
    import sys

    draft = tmp_path / "draft"
    subprocess.run([sys.executable, "-c", "import shutil, sys; from tests.tiny_models import "
                    "tiny_model_dir; shutil.copytree(tiny_model_dir('llama'), sys.argv[1])",
                    str(draft)], check=True, capture_output=True)  # this process has no torch
    menus = win.option_menus
    assert menus.ngram_action.isChecked() and menus.draft_action.text() == "Draft model…"
    prompt = "Name three colours."
    plain = _greedy_reply(win, qtbot, prompt, 40)
    menus.choose_draft_model()
    dialog = menus.draft_dialog
    assert dialog.load_button.text() == "Use as draft model"
    dialog.load_requested.emit(str(draft / "config.json"))  # what *Use* sends for a row
    _restarted(win, qtbot, speculative=True)
    i = win.supervisor.command.index("--speculative-config")
    assert json.loads(win.supervisor.command[i + 1]) == {"model": str(draft),
                                                         "num_speculative_tokens": 4}
    assert win.settings.value("engine/draft_model") == str(draft)
    assert menus.draft_action.isChecked() and menus.draft_action.text() == "Draft model: draft…"
    spec = _greedy_reply(win, qtbot, prompt, 40)
    assert spec.messages[-1].content == plain.messages[-1].content
    counters = win.history.latest.counters
    assert counters["spec_decode_num_accepted_tokens"] >= 0.5 * counters[
        "spec_decode_num_draft_tokens"] > 0  # fmt: skip
    win.set_speculative_tokens(0)  # back, for whatever runs next in this module
    menus.set_draft_model(None)
    _restarted(win, qtbot, speculative=False)
    assert menus.ngram_action.isChecked()
    with pytest.raises(ValueError, match="neither a .gguf file nor a folder"):
        menus.set_draft_model(str(tmp_path / "nothing-here"))
