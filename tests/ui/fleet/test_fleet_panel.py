"""The fleet panel over three fake servers (tests/app/remote/fake_server.py: /metrics fixtures,
/tokenize) and their fake KV event publishers (tests/ui/remote/fake_kv_publishers.py), offscreen:
each row's figures are what that server's own /metrics fixtures give; the one tree marks every
block by the replicas holding it, as the fixtures' brute-force recount says; a prompt's routing
score per replica is the longest prefix of it that replica's own stored chains hold, walked here
from the fixture; the router's pick is the highest. Bad --fleet values and dialog rows are
refused naming the flag or the row; *Engine → Connect to a fleet…* opens a panel that closes
with the window."""

from __future__ import annotations

import argparse
import itertools
import random

import pytest
from PySide6.QtWidgets import QApplication

from app.__main__ import fleet_arg
from app.conversations import ConversationStore
from app.remote.fleet import FLEET_FORM, Replica, parse_fleet
from app.remote.kv_events_source import KvEventsSource
from app.settings import open_settings
from tests.app.remote.fake_server import FakeServer, fixture_texts
from tests.ui.remote.fake_kv_publishers import MEDIA, FakeCache, FakePublisher, expected_fleet
from ui.fleet.dialog import FleetDialog
from ui.fleet.panel import FleetPanel
from ui.fleet.table import GEN, HITS, KV, RUNNING, WAITING
from ui.window.main_window import EngineSource, MainWindow, wait_until

# per fixture, the figures its two scrapes (2 s apart) give, as tests/ui/remote/
# test_remote_window.py reads them off the single-server view: KV, hits, running, waiting, gen
FIGURES = {"vllm_v1": ("30.0%", "50.0%", "5", "3", "200.0"),
           "sglang": ("30.0%", "40.0%", "8", "2", "250.0"),
           "vllm_v0": ("60.0%", "25.0%", "6", "0", "50.0")}  # fmt: skip
LAYOUTS = {"vllm_v1": "vllm-map", "sglang": "sglang", "vllm_v0": "vllm-array"}
BS = 4  # the fake caches' block size


def scripted_clock():
    ticks = itertools.chain([100.0], itertools.repeat(102.0))
    return lambda: next(ticks)


def words(text: str) -> list[int]:
    """The fake servers' tokenizer: the prompt is its token ids, space-separated."""
    return [int(w) for w in text.split()]


class Rig:
    def __init__(self, fixtures: list[str], tokenize: list[bool] | None = None) -> None:
        self.servers = [FakeServer(f.split("_")[0], fixture_texts(f)).start() for f in fixtures]
        for server, ok in zip(self.servers, tokenize or [True] * len(fixtures), strict=True):
            server.tokenize = words if ok else None
        self.pubs = [FakePublisher(LAYOUTS[f]) for f in fixtures]
        # one prompt_seed: the replicas share system prompts, so blocks are shared
        self.caches = [FakeCache(seed=i, block_size=BS, media=MEDIA[LAYOUTS[f]][:1])
                       for i, f in enumerate(fixtures)]  # fmt: skip
        self.replicas = [Replica(s.url, KvEventsSource(p.endpoint, p.replay_endpoint))
                         for s, p in zip(self.servers, self.pubs, strict=True)]  # fmt: skip
        self.panel = FleetPanel(self.replicas, scraper_options={
            "interval": 0.1, "timeout": 5.0, "clocks": [scripted_clock() for _ in fixtures]})
        self.panel.resize(1200, 800)
        self.panel.show()
        self.panel.start()

    def drive(self, steps: int) -> None:
        for pub, cache in zip(self.pubs, self.caches, strict=True):
            for _ in range(steps):
                pub.publish(cache.step())

    def close(self) -> None:
        self.panel.stop()
        self.panel.close()
        for part in (*self.servers, *self.pubs):
            part.close() if hasattr(part, "pub") else part.stop()


@pytest.fixture
def rig(qapp):
    rigs: list[Rig] = []

    def make(*args, **kw) -> Rig:
        rigs.append(Rig(*args, **kw))
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()


def marks(panel: FleetPanel) -> dict:
    """The drawn tree: hash -> (parent or None, tokens, the replicas marked on it)."""
    lay = panel.tree_panel.layout_
    if lay is None:
        return {}
    return {lay.hashes[i]: (lay.hashes[p] if (p := int(lay.parent[i])) >= 0 else None,
                            tuple(lay.tokens[i]), lay.media[i])
            for i in range(lay.num_blocks)}  # fmt: skip


def recounted(r: Rig) -> dict:
    held = {rep.label: pub.expected() for rep, pub in zip(r.replicas, r.pubs, strict=True)}
    fleet = expected_fleet(held)
    return {h: (p if p in fleet else None, toks, sources)
            for h, (p, toks, _, sources) in fleet.items()}  # fmt: skip


def walked_prefix(held: dict, tokens: list[int]) -> int:
    """The longest prefix of `tokens`, in tokens, a publisher's recount holds: from its roots,
    block by block, each a child (by parent hash) of the last with the prompt's next tokens."""
    frontier: set = {None}
    n = 0
    for start in range(0, len(tokens) - BS + 1, BS):
        chunk = tuple(tokens[start : start + BS])
        frontier = {h for h, (p, toks, _) in held.items() if p in frontier and toks == chunk}
        if not frontier:
            break
        n += BS
    return n


def deepest_chain(held: dict) -> list[int]:
    """The tokens of the longest chain a publisher holds whole (every ancestor held)."""
    best: list[int] = []
    for h in held:
        toks: list[int] = []
        while h is not None and h in held:
            p, t, _ = held[h]
            toks = list(t) + toks
            h = p
        if h is None and len(toks) > len(best):
            best = toks
    return best


def settle(r: Rig, timeout: float = 30) -> bool:
    app = QApplication.instance()
    return wait_until(lambda: marks(r.panel) == recounted(r) and all(
        r.panel.table.text(i, GEN) != "—" for i in range(len(r.replicas))), timeout, app)


def test_rows_tree_and_routing_match_the_fixtures(rig):
    r = rig(["vllm_v1", "sglang", "vllm_v0"])
    r.drive(60)
    assert settle(r), (len(marks(r.panel)), len(recounted(r)))
    table = r.panel.table
    for i, fixture in enumerate(FIGURES):
        cells = tuple(table.text(i, c) for c in (KV, HITS, RUNNING, WAITING, GEN))
        assert cells == FIGURES[fixture], fixture
    # blocks shared by several replicas are marked with each of them, and the hover names them
    assert any(len(m) > 1 for _, _, m in marks(r.panel).values())
    lay = r.panel.tree_panel.layout_
    assert wait_until(lambda: r.panel.tree_panel.kind.size == r.panel.tree_panel.layout_.num_blocks,
                      5, QApplication.instance())  # drawn, not only laid out
    lay = r.panel.tree_panel.layout_
    shared = next(i for i in range(lay.num_blocks) if len(lay.media[i]) > 1)
    hover = r.panel.tree_panel.describe(shared)
    assert f"held by {len(lay.media[shared])} replica(s): " in hover
    assert all(label in hover for label in lay.media[shared])
    r.panel.refresh()
    held = r.panel.feed.tree.sources()
    for i, (rep, pub) in enumerate(zip(r.replicas, r.pubs, strict=True)):
        assert held[rep.kv_events.name] == len(pub.expected())
        assert table.text(i, 6) == f"{len(pub.expected()):,}"
    # a prompt continuing replica 1's deepest held chain, then tokens nobody holds
    b_held = r.pubs[1].expected()
    prompt = deepest_chain(b_held) + [random.Random(7).randrange(1000, 2000) for _ in range(6)]
    r.panel.prompt.setText(" ".join(map(str, prompt)))
    r.panel.route()
    app = QApplication.instance()
    assert wait_until(lambda: len(r.panel._tokens) == 3, 10, app)
    want = [walked_prefix(pub.expected(), prompt) for pub in r.pubs]
    assert [s.tokens for s in r.panel.scores] == want
    assert want[1] == len(deepest_chain(b_held)) > 0
    assert r.panel.chosen == want.index(max(want))
    assert "router's pick" in table.text(r.panel.chosen, 7)
    assert r.panel.replicas[r.panel.chosen].label in r.panel.route_note.text()


def test_a_server_without_tokenize_is_said_and_not_scored(rig):
    r = rig(["vllm_v1", "sglang"], tokenize=[True, False])
    r.drive(20)
    assert settle(r)
    prompt = deepest_chain(r.pubs[0].expected())
    r.panel.prompt.setText(" ".join(map(str, prompt)))
    r.panel.route()
    assert wait_until(lambda: len(r.panel._tokens) == 2, 10, QApplication.instance())
    assert r.panel.scores[0].tokens == walked_prefix(r.pubs[0].expected(), prompt)
    assert r.panel.scores[1].tokens is None
    assert "has no /tokenize" in r.panel.table.text(1, 7)


def test_fleet_flag_and_dialog_refuse_bad_input_naming_where(qapp):
    ns = argparse.Namespace(fleet="http://a:1=tcp://a:5557+tcp://a:5558,http://b:1",
                            connect=None, kv_events=None, kv_events_replay=None)  # fmt: skip
    reps = fleet_arg(ns)
    assert [(x.url, x.kv_events) for x in reps] == [
        ("http://a:1", KvEventsSource("tcp://a:5557", "tcp://a:5558")), ("http://b:1", None)]
    for bad, says in (("", FLEET_FORM), ("http://a:1=tcp://*:5557", "name its host"),
                      ("http://a:1=+tcp://a:2", FLEET_FORM), ("a:1,a:1", "given twice")):
        with pytest.raises(ValueError, match="--fleet") as err:
            parse_fleet(bad)
        assert says in str(err.value)
    ns.connect = "http://c:1"
    with pytest.raises(ValueError, match="not with --connect"):
        fleet_arg(ns)
    d = FleetDialog(rows=2)
    d.add_row("http://x:1", "tcp://x:5557")
    d.rows.item(0, 0).setText("http://y:1")
    d.rows.item(0, 1).setText("tcp://*:5557")
    d.accept()
    assert d.isVisible() or "row 1" in d.error.text()
    assert "row 1" in d.error.text() and "name its host" in d.error.text()
    d.rows.item(0, 1).setText("tcp://y:5557")
    assert [x.url for x in d.replicas()] == ["http://y:1", "http://x:1"]
    d.close()


def test_the_engine_menu_opens_a_fleet_panel_closed_with_the_window(qapp, tmp_path):
    with FakeServer("vllm", fixture_texts("vllm_v1")) as watched, \
            FakeServer("sglang", fixture_texts("sglang")) as replica:
        link = {"scrape_interval": 0.1, "retry_interval": 0.2, "connect_timeout": 5.0}
        win = MainWindow(open_settings(tmp_path), ConversationStore(tmp_path / "conversations"),
                         EngineSource(connect=watched.url, link_options=link), data_dir=tmp_path)
        win.show()
        win.start_engine()
        app = QApplication.instance()
        try:
            assert wait_until(lambda: win.state in ("ready", "busy"), 30, app)
            win.fleet_action.trigger()
            dialog = win.fleet.dialog
            assert dialog is not None and dialog.isVisible()
            dialog.rows.item(0, 0).setText(replica.url)
            dialog.accept()
            assert len(win.fleet.panels) == 1
            panel = win.fleet.panels[0]
            assert panel.replicas == [Replica(replica.url)]
            assert wait_until(lambda: panel.table.text(0, RUNNING) == "8", 20, app)
            assert panel.table.text(0, 6) == "no events"
        finally:
            win.shutdown()
            win.close()
        assert not win.fleet.panels and not panel.isVisible()
