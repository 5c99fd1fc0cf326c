"""The fleet panel over three real `kvscope serve` processes (tiny model) publishing KV events
in vLLM's format (`--kv-events-config`), each sent its own prompt: the rows' gauges equal each
server's own /metrics, the prefix hit rate is that of its own counters over the traffic sent,
and a prompt continuing what replica B served scores highest on B, with the prefix B's events
hold as rebuilt here by a subscriber written from vLLM's source alone
(tests/engine_proc/server/vllm_subscriber.py)."""

from __future__ import annotations

import json
import re
import socket

import httpx
import pytest
from PySide6.QtWidgets import QApplication

from app.remote.fleet import Replica
from app.remote.kv_events_source import KvEventsSource
from tests.app.api.helpers import ServeProc
from tests.engine_proc.server import vllm_subscriber as S
from ui.fleet.panel import FleetPanel
from ui.fleet.table import DASH, HITS, KV, RUNNING, WAITING
from ui.window.main_window import wait_until

pytestmark = pytest.mark.slow

PROMPTS = [
    "The harbour master counted the fishing boats twice every morning before the fog lifted, "
    "writing each name in a ledger bound in green leather that smelled of salt and tar.",
    "Our bakery opens at six: rye, spelt and sourdough loaves come out of the wood oven first, "
    "then the croissants, and by noon the shelves are usually empty again.",
    "In the mountain observatory the astronomers waited for clear skies, polishing the mirror "
    "and recalibrating the spectrograph while the wind rattled the copper dome all night.",
]
MORE = " Then the story went on for a while, with more words nobody has cached yet."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(tiny_dir) -> tuple[ServeProc, KvEventsSource]:
    pub, replay = _free_port(), _free_port()
    # '*' binds (vLLM's rule); the subscriber connects over loopback
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
           "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"}  # fmt: skip
    proc = ServeProc(["--port", "0", "--model", str(tiny_dir), "--dtype", "float32",
                      "--decode-weights", "dense", "--kv-events-config", json.dumps(cfg),
                      "--engine-args", "--num-threads 1 --num-kv-blocks 64 --telemetry-hz 5"])
    return proc, KvEventsSource(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")


def scrape(url: str) -> dict[str, float]:
    """The /metrics samples (unlabelled names, or the first labelled one), read here."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for m in re.finditer(r"^kvscope:(\w+)(?:{[^}]*})? (\S+)$", text, re.M):
        out.setdefault(m.group(1), float(m.group(2)))
    return out


def gauges(url: str) -> tuple[str, str, str]:
    """KV usage, running, waiting as the table writes them."""
    v = scrape(url)
    return (f"{100 * v['kv_cache_usage_perc']:.1f}%", f"{v['num_requests_running']:,.0f}",
            f"{v['num_requests_waiting']:,.0f}")


def hit_rate(before: dict[str, float], url: str) -> str:
    """Prefix-cache hits over queries since `before`, as the table writes it."""
    after = scrape(url)
    dq = after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"]
    dh = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
    return f"{100 * dh / dq:.1f}%"


def events_tree(src: KvEventsSource) -> S.Tree:
    """Replica's blocks from its replay endpoint, by the vLLM-only subscriber."""
    sub = S.Subscriber(src.endpoint, src.replay, b"kv-events")
    try:
        tree = S.Tree()
        for _, _, payload in sub.replay(0):
            for event in S.decode_payload(payload)[1]:
                tree.apply(S.normalize(event))
        return tree
    finally:
        sub.close()


def walked(tree: S.Tree, tokens: list[int], bs: int) -> int:
    frontier: set = {None}
    n = 0
    for start in range(0, len(tokens) - bs + 1, bs):
        chunk = tokens[start : start + bs]
        frontier = {h for h, node in tree.nodes.items()
                    if node.parent in frontier and list(node.tokens) == chunk}  # fmt: skip
        if not frontier:
            break
        n += bs
    return n


def test_three_kvscope_servers(tiny_dir, qapp):
    procs = [_serve(tiny_dir) for _ in PROMPTS]
    panel = None
    try:
        for proc, _ in procs:
            proc.wait_healthy()
        replicas = [Replica(p.url, src) for p, src in procs]
        app = QApplication.instance()
        # /metrics is empty until the engine's first telemetry: wait for the counters
        assert wait_until(lambda: all("prefix_cache_queries_total" in scrape(p.url)
                                      for p, _ in procs), 60, app)  # fmt: skip
        before = [scrape(p.url) for p, _ in procs]  # = the panel's first scrapes: no traffic yet
        # a window over the whole test: its rates span all the traffic sent here
        panel = FleetPanel(replicas, scraper_options={"interval": 0.2, "window_s": 3600.0})
        panel.show()
        panel.start()
        for (proc, _), prompt in zip(procs, PROMPTS, strict=True):
            r = httpx.post(proc.url + "/v1/completions", timeout=120,
                           json={"prompt": prompt, "max_tokens": 2})  # fmt: skip
            assert r.status_code == 200, r.text
        # every replica's blocks arrived, and its gauges settled (no request left)
        assert wait_until(lambda: all(
            panel.feed is not None and panel.feed.tree.sources().get(src.name, 0) > 0
            for _, src in procs), 60, app)
        b = 1
        bproc, bsrc = procs[b]
        tokens = httpx.post(bproc.url + "/tokenize", json={"prompt": PROMPTS[b] + MORE},
                            timeout=30).json()["tokens"]  # fmt: skip
        # B's blocks as its replay endpoint holds them, once the panel's feed holds as many
        # (events come in batches: a read between two would miss the later ones)
        held: dict[str, S.Tree] = {}

        def b_events_settled() -> bool:
            held["tree"] = events_tree(bsrc)
            return panel.feed.tree.sources().get(bsrc.name, 0) == len(held["tree"].nodes)

        assert wait_until(b_events_settled, 30, app)
        tree = held["tree"]
        bs = len(next(iter(tree.nodes.values())).tokens)
        want_b = walked(tree, tokens, bs)
        assert want_b >= bs
        panel.prompt.setText(PROMPTS[b] + MORE)
        panel.route()
        assert wait_until(lambda: len(panel._tokens) == 3 and all(
            s.tokens is not None for s in panel.scores), 30, app), panel.scores
        assert panel.scores[b].tokens == want_b
        assert all(s.tokens < want_b for i, s in enumerate(panel.scores) if i != b)
        assert panel.chosen == b
        # the blocks column: what B's events hold, as the vLLM-only subscriber counts them
        panel.refresh()
        assert panel.table.text(b, 6) == f"{len(tree.nodes):,}"
        # the figures: the table's gauges equal each server's /metrics, read here
        for i, (proc, _) in enumerate(procs):
            assert wait_until(lambda i=i, proc=proc: tuple(
                panel.table.text(i, c) for c in (KV, RUNNING, WAITING)) == gauges(proc.url),
                20, app), (i, gauges(proc.url))
        # B is sent the routed prompt: its cached prefix is a hit in B's own counters. The
        # table's rate is over the remote view's last 10 s: on a loaded machine the first
        # requests may have left that window, so a replica's rate is the one since `before`
        # (all its traffic in the window), or, for B, the routed request's alone, or "—" for a
        # replica whose queries all left the window.
        just_before_b = scrape(bproc.url)
        r = httpx.post(bproc.url + "/v1/completions", timeout=120,
                       json={"prompt": PROMPTS[b] + MORE, "max_tokens": 2})  # fmt: skip
        assert r.status_code == 200, r.text
        # its counters in /metrics (the server's latest engine snapshot) once they count it
        assert wait_until(lambda: (m := scrape(bproc.url))["prefix_cache_queries_total"]
                          > just_before_b["prefix_cache_queries_total"]
                          and m["num_requests_running"] == 0, 20, app)  # fmt: skip
        for i, (proc, _) in enumerate(procs):
            allowed = {hit_rate(before[i], proc.url)}
            allowed |= {hit_rate(just_before_b, proc.url)} if i == b else {DASH}
            assert wait_until(lambda i=i, allowed=allowed: panel.table.text(i, HITS) in allowed,
                              20, app), (i, panel.table.text(i, HITS), allowed)
        assert panel.table.text(b, HITS) not in ("0.0%", DASH)
    finally:
        if panel is not None:
            panel.stop()
            panel.close()
        for proc, _ in procs:
            proc.stop()
