"""The soak's clients: each actor loops over random actions (seeded) until the deadline and
records every request's outcome. An outcome that is neither a terminal response nor a clean,
expected error is a failure of the run."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import zmq

from ipc import protocol as P
from ipc.client import EngineClient, EngineError

REQUEST_TIMEOUT = 120.0  # a request with no terminal answer by then counts as hung
SYSTEM_PROMPTS = [
    "You are a helpful assistant who answers in one short paragraph. " * k for k in (1, 3, 6)
]
WORDS = "paged attention block table prefix cache scheduler chunked prefill decode token".split()


@dataclass
class Tally:
    """Outcomes of every request, by kind; failures listed with what happened."""

    outcomes: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, tokens: int = 0, error: str | None = None) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            self.tokens += tokens
            if error is not None:
                self.errors[error] += 1

    def fail(self, what: str) -> None:
        with self.lock:
            self.outcomes["failure"] += 1
            self.failures.append(what)


def _prompt(rng: random.Random) -> list[dict]:
    user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
            {"role": "user", "content": user}]  # fmt: skip


def _sampling(rng: random.Random) -> dict:
    return {
        "max_tokens": rng.randint(1, 48),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "top_p": rng.choice([1.0, 0.9]),
        "top_k": rng.choice([0, 20]),
        "n": rng.choice([1, 1, 1, 2, 3]),
        "seed": rng.choice([None, rng.randrange(1000)]),
    }


class ZmqActor:
    def __init__(self, endpoint: str, tally: Tally, seed: int) -> None:
        self.endpoint = endpoint
        self.tally = tally
        self.rng = random.Random(seed)

    def run(self, deadline: float) -> None:
        client = EngineClient(self.endpoint, client_name="soak")
        try:
            while time.monotonic() < deadline:
                roll = self.rng.random()
                if roll < 0.05:
                    self.malformed()
                elif roll < 0.10:
                    self.vanish_mid_stream()  # the engine must clean up after it
                else:
                    self.one_request(client, abort=roll < 0.2)
        finally:
            client.close()

    def one_request(self, client: EngineClient, abort: bool) -> None:
        params = _sampling(self.rng)
        try:
            stream = client.chat(_prompt(self.rng), **params)
            seen = 0
            for event in iter_with_timeout(stream, REQUEST_TIMEOUT):
                if isinstance(event, P.Delta):
                    seen += len(event.token_ids)
                    if abort and seen >= 2:
                        stream.abort()
                        abort = False
            reasons = {f.reason for f in stream.finishes.values()}
            if len(stream.finishes) != params["n"]:
                self.tally.fail(f"zmq {stream.request_id}: {len(stream.finishes)} finishes of "
                                f"{params['n']}")  # fmt: skip
            elif reasons - {"stop", "length", "abort"}:
                self.tally.fail(f"zmq {stream.request_id}: finish reasons {reasons}")
            else:
                kind = "zmq_aborted" if "abort" in reasons else "zmq_completed"
                self.tally.add(kind, tokens=seen)
        except EngineError as exc:
            self.tally.fail(f"zmq request: unexpected error [{exc.code}] {exc.message}")
        except TimeoutError as exc:
            self.tally.fail(f"zmq request hung: {exc}")

    def vanish_mid_stream(self) -> None:
        client = EngineClient(self.endpoint, client_name="soak-vanish")
        try:
            stream = client.chat(_prompt(self.rng), max_tokens=64, temperature=0)
            stream.next_event(timeout=REQUEST_TIMEOUT)
            self.tally.add("zmq_vanished")
        except EngineError as exc:
            self.tally.fail(f"zmq vanish: [{exc.code}] {exc.message}")
        finally:
            client.close()

    def malformed(self) -> None:
        """A raw DEALER sends one bad message; the engine must answer with the documented code."""
        cases = [
            (b"\xc1not msgpack", P.ERR_BAD_MESSAGE),
            (P.encode(P.Heartbeat()).replace(b"heartbeat", b"heartbeep"), P.ERR_UNKNOWN_KIND),
            (_generate_with(temperature=-1.0), P.ERR_INVALID_REQUEST),
            (_generate_with(top_p="x"), P.ERR_INVALID_MESSAGE),
        ]
        data, code = self.rng.choice(cases)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.endpoint)
            sock.send(data)
            if not sock.poll(int(REQUEST_TIMEOUT * 1000)):
                self.tally.fail(f"zmq malformed ({code}): no answer")
                return
            reply = P.decode_engine(sock.recv())
            if isinstance(reply, P.Error) and reply.code == code:
                self.tally.add("zmq_malformed", error=code)
            else:
                self.tally.fail(f"zmq malformed: expected {code}, got {reply}")
        finally:
            sock.close()


def _generate_with(**sampling: object) -> bytes:
    msg = {"kind": "generate", "request_id": f"bad-{random.random()}", "prompt": "hi",
           "sampling": sampling}  # fmt: skip
    import msgspec

    return msgspec.msgpack.encode(msg)


def iter_with_timeout(stream, timeout: float):
    deadline = time.monotonic() + timeout
    while not stream.done:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{stream.request_id} not finished in {timeout} s")
        try:
            event = stream.next_event(timeout=left)
        except StopIteration:
            return
        if event is not None:
            yield event


AGENT_SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]},
                   "count": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["colour", "count"],
    "additionalProperties": False,
}  # fmt: skip
AGENT_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}  # fmt: skip


def _constrained_reply_problem(kind: str, choice: dict) -> str | None:
    """Why a chat choice under a schema or a forced tool call is wrong, or None."""
    if choice["finish_reason"] == "length":
        return None  # cut by max_tokens: nothing to check
    if kind == "schema":
        value = json.loads(choice["message"]["content"])
        ok = value.get("colour") in AGENT_SCHEMA["properties"]["colour"]["enum"]
        return None if ok and 0 <= value.get("count", -1) <= 9 else "schema not followed"
    calls = choice["message"].get("tool_calls") or []
    if choice["finish_reason"] != "tool_calls" or len(calls) != 1:
        return "the required tool call is missing"
    args = json.loads(calls[0]["function"]["arguments"])
    return None if args.get("city") in ("Paris", "Oslo") else "arguments not followed"


class HttpActor:
    def __init__(self, url: str, api_key: str, tally: Tally, seed: int) -> None:
        self.url = url
        self.headers = {"authorization": f"Bearer {api_key}"}
        self.tally = tally
        self.rng = random.Random(seed)

    def run(self, deadline: float) -> None:
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=REQUEST_TIMEOUT) as http:
            while time.monotonic() < deadline:
                roll = self.rng.random()
                try:
                    if roll < 0.05:
                        self.malformed(http)
                    elif roll < 0.15:
                        self.disconnect_mid_stream()
                    elif roll < 0.25:
                        self.agent_request(http, stream=roll < 0.2)
                    elif roll < 0.28:
                        self.agent_malformed(http)
                    elif roll < 0.34:
                        self.constrained_request(http)
                    else:
                        self.one_request(http, stream=roll < 0.6)
                except httpx.HTTPError as exc:
                    self.tally.fail(f"http transport error: {exc!r}")

    def body(self) -> dict:
        s = _sampling(self.rng)
        if s["seed"] is None:
            del s["seed"]
        if self.rng.random() < 0.5:
            return {"messages": _prompt(self.rng), **s}
        return {"prompt": " ".join(m["content"] for m in _prompt(self.rng)), **s}

    def one_request(self, http: httpx.Client, stream: bool) -> None:
        body = self.body()
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        if not stream:
            r = http.post(path, json=body)
            if r.status_code != 200:
                self.tally.fail(f"http {path}: {r.status_code} {r.text[:200]}")
                return
            out = r.json()
            if len(out["choices"]) != body["n"]:
                self.tally.fail(f"http {path}: {len(out['choices'])} choices of {body['n']}")
                return
            self.tally.add("http_completed", tokens=out["usage"]["completion_tokens"])
            return
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        finished: set[int] = set()
        done = usage = False
        with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                r.read()
                self.tally.fail(f"http stream {path}: {r.status_code} {r.text[:200]}")
                return
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.tally.fail(f"http stream error event: {chunk['error']}")
                    return
                usage = usage or bool(chunk.get("usage"))
                finished |= {c["index"] for c in chunk["choices"] if c.get("finish_reason")}
        if not done or len(finished) != body["n"] or not usage:
            self.tally.fail(f"http stream {path}: done={done} finished={sorted(finished)} "
                            f"of n={body['n']} usage={usage}")  # fmt: skip
            return
        self.tally.add("http_stream_completed")

    def disconnect_mid_stream(self) -> None:
        body = {"messages": _prompt(self.rng), "max_tokens": 64, "stream": True}
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=REQUEST_TIMEOUT) as h:
            with h.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    self.tally.fail(f"http disconnect: {r.status_code}")
                    return
                next(r.iter_lines(), None)
        self.tally.add("http_disconnected")

    def malformed(self, http: httpx.Client) -> None:
        cases = [
            (b"{not json", 400),
            (json.dumps({"messages": [], "max_tokens": 2}).encode(), 400),
            (json.dumps({"prompt": "x", "temperature": "hot"}).encode(), 400),
            (json.dumps({"prompt": "x", "temprature": 0}).encode(), 400),
        ]
        data, status = self.rng.choice(cases)
        path = "/v1/chat/completions" if b"messages" in data else "/v1/completions"
        r = http.post(path, content=data, headers={"content-type": "application/json"})
        if r.status_code == status and "error" in r.json():
            self.tally.add("http_malformed", error=f"http_{status}")
        else:
            self.tally.fail(f"http malformed: expected {status}, got {r.status_code}")


    def agent_request(self, http: httpx.Client, stream: bool) -> None:
        """The Responses or the Messages API (app/api/openai_responses.py, anthropic_messages.py),
        streamed or not; a stream must end with its API's last event."""
        prompt = _prompt(self.rng)
        max_tokens = self.rng.randint(1, 32)
        if self.rng.random() < 0.5:
            path, last = "/v1/responses", ("response.completed", "response.incomplete")
            body: dict = {"instructions": prompt[0]["content"], "input": prompt[1]["content"],
                          "max_output_tokens": max_tokens}  # fmt: skip
        else:
            path, last = "/v1/messages", ("message_stop",)
            body = {"system": prompt[0]["content"], "max_tokens": max_tokens,
                    "messages": [prompt[1]]}  # fmt: skip
        body["temperature"] = self.rng.choice([0.0, 0.7])
        if not stream:
            r = http.post(path, json=body)
            if r.status_code != 200:
                self.tally.fail(f"http {path}: {r.status_code} {r.text[:200]}")
                return
            usage = r.json()["usage"]
            self.tally.add("http_agent_completed", tokens=usage["output_tokens"])
            return
        body["stream"] = True
        events: list[str] = []
        with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                r.read()
                self.tally.fail(f"http stream {path}: {r.status_code} {r.text[:200]}")
                return
            events = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
        if not events or events[-1] not in last or "error" in events:
            self.tally.fail(f"http stream {path}: events end with {events[-3:]}")
            return
        self.tally.add("http_agent_stream_completed")

    def constrained_request(self, http: httpx.Client) -> None:
        """What agents send to chat completions: a JSON schema or a forced tool call. A reply
        that ended on its own must be what was asked for."""
        kind = self.rng.choice(("schema", "tool"))
        body: dict = {"messages": _prompt(self.rng), "max_tokens": 48}
        if kind == "schema":
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "pick", "schema": AGENT_SCHEMA}}
            body["seed"] = self.rng.randrange(1000)
        else:
            body |= {"tools": [AGENT_TOOL], "tool_choice": "required",
                     "parallel_tool_calls": False}  # fmt: skip
        r = http.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            self.tally.fail(f"http {kind}: {r.status_code} {r.text[:200]}")
            return
        out = r.json()
        why = _constrained_reply_problem(kind, out["choices"][0])
        if why:
            self.tally.fail(f"http {kind}: {why}: {json.dumps(out)[:300]}")
            return
        self.tally.add("http_constrained_completed", tokens=out["usage"]["completion_tokens"])

    def agent_malformed(self, http: httpx.Client) -> None:
        """Each answered with a 400 in its API's own error shape."""
        msgs = [{"role": "user", "content": "hi"}]
        cases = [
            ("/v1/chat/completions", {"messages": msgs, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": 7}}}),
            ("/v1/chat/completions", {"messages": msgs, "tools": [AGENT_TOOL], "tool_choice": {
                "type": "function", "function": {"name": "no_such_tool"}}}),
            ("/v1/responses", {"input": "x", "previous_response_id": "resp_1"}),
            ("/v1/responses", {"input": [{"type": "item_reference", "id": "x"}]}),
            ("/v1/messages", {"messages": [{"role": "user", "content": "x"}]}),  # no max_tokens
            ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {}}]}]}),
        ]  # fmt: skip
        path, body = self.rng.choice(cases)
        r = http.post(path, json=body)
        out = r.json() if r.headers.get("content-type", "").startswith("application/json") \
            else {}  # fmt: skip
        shaped = out.get("type") == "error" if path == "/v1/messages" else "error" in out
        if r.status_code == 400 and shaped:
            self.tally.add("http_malformed", error="http_400")
        else:
            self.tally.fail(f"http malformed {path}: expected 400, got {r.status_code} {out}")


class ControlActor:
    """Live control changes while the others run: limits, the caching switch, flushes."""

    def __init__(self, endpoint: str, tally: Tally, seed: int) -> None:
        self.endpoint = endpoint
        self.tally = tally
        self.rng = random.Random(seed)

    def run(self, deadline: float) -> None:
        with EngineClient(self.endpoint, client_name="soak-control") as client:
            while time.monotonic() < deadline:
                time.sleep(self.rng.uniform(0.5, 2.0))
                op = self.rng.choice(["limits", "caching", "flush"])
                try:
                    if op == "limits":
                        client.set_limits(
                            max_num_seqs=self.rng.choice([4, 16, 64]),
                            max_num_batched_tokens=self.rng.choice([64, 256, 2048]),
                            long_prefill_chunk=self.rng.choice([0, 32, 512]),
                        )
                    elif op == "caching":
                        client.set_prefix_caching(self.rng.random() < 0.7)
                    else:
                        client.reset_prefix_cache()
                    self.tally.add(f"control_{op}")
                except EngineError as exc:
                    self.tally.fail(f"control {op}: [{exc.code}] {exc.message}")
            client.set_prefix_caching(True)
