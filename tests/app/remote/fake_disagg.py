"""A scripted stand-in for `kvscope serve --disaggregated` (tests/app/remote/fake_server.py plus the
/kvscope/* routes of docs/PROTOCOL.md section 9): /kvscope/deployment, each engine's welcome and
telemetry (`?engine=prefill|decode`) from scripted snapshots, and an engine that can be down
(503 for its routes, "gone" in the deployment)."""

from __future__ import annotations

import http.server
import json
import threading
from urllib.parse import parse_qs, urlsplit

import numpy as np

from ipc import protocol as P
from tests.app.remote.fake_server import FakeServer, _Handler

ROLES = ("prefill", "decode")
CONFIG = P.LiveConfig(max_num_seqs=8, max_num_batched_tokens=256, long_prefill_chunk=128,
                      enable_prefix_caching=True)  # fmt: skip
METRICS = "kvscope:num_requests_running 0\nkvscope:num_requests_waiting 0\n"


def welcome(role: str, num_blocks: int, client_id: str | None = None) -> P.Welcome:
    model = P.ModelInfo(name="fake-disagg", architecture="LlamaForCausalLM", num_layers=2,
                        num_kv_heads=2, head_dim=16, dtype="float32", device="cpu",
                        block_size=16, num_blocks=num_blocks, kv_bytes_per_token=256,
                        max_model_len=512, role=role)  # fmt: skip
    return P.Welcome(protocol_version=1, client_id=client_id or role, model=model, config=CONFIG,
                     pub_endpoint="tcp://127.0.0.1:1", telemetry_hz=20.0, heartbeat_interval=1.0,
                     client_timeout=10.0, max_message_bytes=1 << 20, server_time=0.0)  # fmt: skip


def snapshot(seq: int, t: float, counters: dict[str, float], state: np.ndarray,
             requests: list[P.RequestState]) -> P.Telemetry:
    n = len(state)
    blocks = P.BlockArrays.pack(
        state=state, ref_count=(state == 2).astype(np.int32), filled=np.zeros(n, np.int32),
        short_hash=np.where(state > 0, np.arange(1, n + 1), 0).astype(np.uint32),
        parent=np.full(n, -1, np.int32))  # fmt: skip
    return P.Telemetry(seq=seq, time=t, counters=counters, config=CONFIG, blocks=blocks,
                       requests=requests)


class FakeDisagg(FakeServer):
    """`snapshots[role]` are streamed to each telemetry subscriber, then the stream stays open
    (until stop); `down[role]` makes that engine's routes answer 503."""

    def __init__(self, welcomes: dict[str, P.Welcome], snapshots: dict[str, list[P.Telemetry]],
                 **kwargs) -> None:
        super().__init__("kvscope", [METRICS], **kwargs)
        self.welcomes = welcomes
        self.snapshots = snapshots
        self.down: dict[str, str] = {}
        self.single = False  # say it fronts one engine (the decode engine's snapshots)
        self.closing = threading.Event()

    def start(self) -> FakeDisagg:
        server = self

        class Handler(_DisaggHandler):
            fake = server

        self.closing.clear()
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        httpd.daemon_threads = True
        self.port = httpd.server_address[1]
        self.httpd = httpd
        threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()
        return self

    def stop(self) -> None:
        self.closing.set()
        super().stop()

    def deployment(self) -> dict:
        if self.single:
            return {"disaggregated": False, "engines": {"engine": "ready"},
                    "detail": {"engine": "serving"}}  # fmt: skip
        return {"disaggregated": True,
                "engines": {r: "gone" if r in self.down else "ready" for r in ROLES},
                "detail": {r: self.down.get(r, "serving") for r in ROLES}}  # fmt: skip


class _DisaggHandler(_Handler):
    fake: FakeDisagg

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlsplit(self.path)
        if not url.path.startswith("/kvscope/"):
            super().do_GET()
            return
        if not self._authorized():
            return
        f = self.fake
        # no engine named: the deployment's own answer, which is the decode engine's while it
        # is up (app/router/router.py DisaggRouter)
        default = "prefill" if "decode" in f.down else "decode"
        role = parse_qs(url.query).get("engine", [default])[-1]
        if url.path == "/kvscope/deployment":
            self._send(200, json.dumps(f.deployment()).encode())
        elif role in f.down:
            body = {"error": {"message": f"the {role} engine is not ready: {f.down[role]}",
                              "type": "unavailable_error", "code": "engine_unavailable"}}
            self._send(503, json.dumps(body).encode())
        elif url.path == "/kvscope/welcome":
            self._send(200, P.encode(f.welcomes[role]), "application/vnd.kvscope.msgpack")
        elif url.path == "/kvscope/telemetry":
            self._telemetry(f.snapshots[role])
        else:
            self._send(404, b'{"detail": "Not Found"}')

    def _telemetry(self, snaps: list[P.Telemetry]) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/vnd.kvscope.msgpack")
        self.send_header("connection", "close")
        self.end_headers()
        try:
            for snap in snaps:
                raw = P.encode(snap)
                self.wfile.write(len(raw).to_bytes(4, "big") + raw)
            self.wfile.flush()
            while not self.fake.closing.wait(0.1):  # open, silent, like an idle engine's relay
                pass
        except OSError:
            pass
        self.close_connection = True
