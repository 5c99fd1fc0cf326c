"""The routes of the Responses and Messages APIs, registered on the ASGI app by server.py.

`POST /v1/responses` and `POST /v1/messages` run through server.py's `run_plan` (admission,
limits, disconnects) with their encoder; the token counts (`/v1/responses/input_tokens`,
`/v1/messages/count_tokens`) ask the engine to render the plan's chat; the routes of stored
responses answer 404 saying the server keeps none. Every error under /v1/messages is in
Anthropic's shape.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from app.api import requests as R
from app.api.agent_runs import APIEncoder
from app.api.anthropic_messages import error_response as anthropic_error
from app.api.anthropic_messages import parse_count_tokens, parse_messages
from app.api.errors import APIError
from app.api.generation import api_error_of, rendered_tools
from app.api.guard import read_json
from app.api.messages_stream import MessagesEncoder
from app.api.openai_responses import not_stored, parse_input_tokens, parse_responses
from app.api.responses_stream import ResponsesEncoder
from app.api.tools.request import apply_model
from ipc.client import EngineError

log = logging.getLogger(__name__)

RunPlan = Callable[[Request, R.GenerationPlan, Callable[[str], APIEncoder]], Awaitable[Response]]


@dataclass(slots=True)
class Serving:
    """What the routes need from create_app: the engine link, the settings, the bounds, the
    served names and run_plan."""

    link: Any  # server.EngineLink (or a disaggregated deployment's link)
    settings: Any  # settings.ServerSettings
    limits: Callable[[], R.Limits]
    served_names: Callable[[], list[str]]
    run_plan: RunPlan

    async def body(self, request: Request) -> Any:
        return await read_json(request, self.settings.max_body_bytes)

    def ready(self, plan: R.GenerationPlan) -> R.GenerationPlan:
        """The plan read as this model's replies are (its tool parser, its thinking)."""
        apply_model(plan, self.link.model_info, self.settings.tool_call_parser)
        return plan

    async def prompt_tokens(self, plan: R.GenerationPlan) -> int:
        """The prompt's token count as the engine renders the plan's chat."""
        client = self.link.ready_client()
        R.check_model(plan.model or None, self.served_names())
        try:
            out = await client.tokenize(messages=plan.messages, tools=rendered_tools(plan),
                                        chat_template_kwargs=plan.chat_template_kwargs)  # fmt: skip
        except EngineError as exc:
            raise api_error_of(exc) from None
        return len(out.token_ids)


def register(app: FastAPI, s: Serving) -> None:
    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = await s.body(request)
        s.link.ready_client()
        call = parse_responses(body, s.limits())
        s.ready(call.plan)
        return await s.run_plan(request, call.plan, lambda model: ResponsesEncoder(call, model))

    @app.post("/v1/responses/input_tokens")
    async def responses_input_tokens(request: Request) -> dict[str, Any]:
        body = await s.body(request)
        s.link.ready_client()
        plan = s.ready(parse_input_tokens(body, s.limits()).plan)
        return {"object": "response.input_tokens", "input_tokens": await s.prompt_tokens(plan)}

    # Stateless: nothing to retrieve, delete or cancel (a 404 that says why, not "no route").
    @app.get("/v1/responses/{response_id}")
    @app.delete("/v1/responses/{response_id}")
    @app.post("/v1/responses/{response_id}/cancel")
    @app.get("/v1/responses/{response_id}/input_items")
    async def stored_response(response_id: str) -> None:
        raise not_stored(response_id)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        try:  # every error in Anthropic's shape, whoever raises it
            body = await s.body(request)
            s.link.ready_client()
            plan = s.ready(parse_messages(body, s.limits()).plan)
            return await s.run_plan(request, plan, MessagesEncoder)
        except APIError as exc:
            return anthropic_error(exc)
        except Exception as exc:
            log.exception("internal error on %s", request.url.path)
            return anthropic_error(APIError(500, f"internal server error: {exc}"))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        """Anthropic's prompt token count (Claude Code asks before long requests)."""
        try:
            body = await s.body(request)
            s.link.ready_client()
            plan = s.ready(parse_count_tokens(body, s.limits()).plan)
            return JSONResponse({"input_tokens": await s.prompt_tokens(plan)})
        except APIError as exc:
            return anthropic_error(exc)
