"""POST /tokenize, as vLLM's OpenAI server and `kvscope serve` answer it: {"prompt": text} ->
{"tokens": [...], "count": n, ...}. No model field: both take the served model when it is
missing, and a fleet's replicas may name theirs differently."""

from __future__ import annotations

import httpx

from app.remote.kvscope_http import RemoteError, auth_headers
from app.remote.openai_client import describe


async def atokenize(http: httpx.AsyncClient, base_url: str, api_key: str | None, prompt: str,
                    timeout: float = 10.0) -> list[int]:  # fmt: skip
    """The prompt's token ids; RemoteError saying why not (no /tokenize, an error, no answer)."""
    try:
        r = await http.post(base_url + "/tokenize", json={"prompt": prompt},
                            headers=auth_headers(api_key), timeout=timeout)  # fmt: skip
    except httpx.TimeoutException:
        raise RemoteError(f"POST /tokenize did not answer within {timeout:g} s") from None
    except httpx.HTTPError as exc:
        raise RemoteError(f"cannot reach {base_url}: {describe(exc)}") from None
    if r.status_code in (404, 405):
        raise RemoteError("this server has no /tokenize", r.status_code)
    if r.status_code >= 400:
        raise RemoteError(f"POST /tokenize answered HTTP {r.status_code}", r.status_code)
    try:
        tokens = r.json()["tokens"]
    except (ValueError, KeyError, TypeError):
        raise RemoteError("POST /tokenize answered without a token list") from None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise RemoteError("POST /tokenize answered without a token list")
    return tokens
