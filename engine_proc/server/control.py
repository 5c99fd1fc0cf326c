"""The engine server's non-generating requests: tokenize, detokenize and control (live limits,
prefix caching, pause, shutdown). A mixin of EngineServer (engine_proc/server/engine_server.py),
which owns the state it reads."""

from __future__ import annotations

import logging
import time
from typing import Any

from engine_proc.engine.chat_render import message_dicts
from ipc import protocol as P

log = logging.getLogger("engine_proc.server")


class Controls:
    """Handlers that need the server's _send, _send_error, _live_config, _publish_telemetry
    and request_stop (EngineServer provides them)."""

    engine: Any
    paused: bool
    _model_info: P.ModelInfo | None

    def _on_tokenize(self, client: Any, msg: P.Tokenize) -> None:
        try:
            if msg.messages is not None:
                ids = self.engine.tokenize_chat(
                    message_dicts(msg.messages), msg.add_generation_prompt, msg.tools,
                    msg.chat_template_kwargs,
                )
                text = self.engine.tokenizer.decode(ids)
            else:
                assert msg.prompt is not None
                ids = self.engine.tokenize_text(msg.prompt, msg.add_special_tokens)
                text = msg.prompt
        except ValueError as exc:
            self._send_error(
                client.routing_id, P.ERR_INVALID_REQUEST, str(exc), request_id=msg.request_id
            )
            return
        self._send_tokenized(client, msg.request_id, ids, text)

    def _on_detokenize(self, client: Any, msg: P.Detokenize) -> None:
        try:
            text = self.engine.detokenize(msg.token_ids)
        except ValueError as exc:
            self._send_error(
                client.routing_id, P.ERR_INVALID_REQUEST, str(exc), request_id=msg.request_id
            )
            return
        self._send_tokenized(client, msg.request_id, list(msg.token_ids), text)

    def _send_tokenized(self, client: Any, rid: str, ids: list[int], text: str) -> None:
        assert self._model_info is not None
        self._send(
            client.routing_id,
            P.Tokenized(
                request_id=rid,
                token_ids=[int(t) for t in ids],
                text=text,
                max_model_len=self._model_info.max_model_len,
            ),
        )

    def _on_control(self, client: Any, msg: P.Control) -> None:
        cid = client.routing_id
        result: bool | None = None
        try:
            if msg.op == "set_limits":
                limits: dict[str, int | bool | None] = {
                    "max_num_seqs": msg.max_num_seqs,
                    "max_num_batched_tokens": msg.max_num_batched_tokens,
                    "long_prefill_chunk": msg.long_prefill_chunk,
                }
                if msg.default_prefill_chunk:  # (asked for only when given)
                    limits["default_prefill_chunk"] = True
                self.engine.set_limits(**limits)
            elif msg.op == "set_prefix_caching":
                self.engine.set_prefix_caching(bool(msg.enable_prefix_caching))
            elif msg.op == "reset_prefix_cache":
                result = bool(self.engine.reset_prefix_cache())
            elif msg.op == "replay_kv_events":
                if not hasattr(self.engine, "replay_kv_events"):
                    raise ValueError("this engine publishes no KV cache events")
                self.engine.replay_kv_events()
            elif msg.op == "pause":
                self.paused = True
            elif msg.op == "resume":
                self.paused = False
        except ValueError as exc:
            self._send_error(cid, P.ERR_INVALID_CONTROL, str(exc), control_id=msg.control_id)
            return
        except Exception as exc:
            log.exception("control %r failed", msg.op)
            self._send_error(
                cid, P.ERR_INTERNAL, f"internal error: {exc}", control_id=msg.control_id
            )
            return
        self._send(
            cid,
            P.ControlAck(
                control_id=msg.control_id,
                op=msg.op,
                config=self._live_config(),
                time=time.monotonic(),
                result=result,
            ),
        )
        self._publish_telemetry()  # the change shows in the very next snapshot
        if msg.op == "shutdown":
            self.request_stop(f"shutdown requested by client {client.name or cid.hex()}")
