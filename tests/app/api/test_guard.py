"""app/api/guard.py: which Host headers and keys pass, without a server."""

from __future__ import annotations

import pytest

from app.api.guard import GuardMiddleware
from app.api.settings import ServerSettings


def _check(settings: ServerSettings, path: str = "/v1/models", **headers: str):
    guard = GuardMiddleware(app=None, settings=settings)  # type: ignore[arg-type]
    scope = {"path": path, "method": "GET"}
    return guard._check(scope, {k.replace("_", "-"): v for k, v in headers.items()})


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("localhost:8000", True), ("127.0.0.1:8000", True), ("127.0.0.2", True),
        ("[::1]:8000", True), ("evil.example", False), ("127.0.0.1.evil.example:80", False),
        ("localhost.evil.example", False), ("", False), ("0x7f.1", False),
    ],
)  # fmt: skip
def test_loopback_servers_answer_only_loopback_host_names(host: str, allowed: bool) -> None:
    error = _check(ServerSettings(host="127.0.0.1"), host=host)
    assert (error is None) == allowed, host
    if error is not None:
        assert error.status == 403 and error.code == "host_not_allowed"


def test_an_allowed_host_name_can_be_added_and_remote_binds_skip_the_check() -> None:
    assert _check(ServerSettings(allowed_hosts=["my-box.local"]), host="my-box.local") is None
    assert _check(ServerSettings(host="0.0.0.0", api_keys=["k" * 16]), host="evil.example",
                  authorization="Bearer " + "k" * 16) is None  # fmt: skip


def test_keys_guard_everything_but_health_metrics_and_version() -> None:
    s = ServerSettings(api_keys=["a" * 16, "b" * 16])
    assert _check(s, host="localhost").status == 401
    assert _check(s, host="localhost", authorization="Bearer " + "c" * 16).status == 401
    assert _check(s, host="localhost", authorization="Basic " + "a" * 16).status == 401
    assert _check(s, host="localhost", authorization="Bearer " + "b" * 16) is None
    assert _check(s, host="localhost", x_api_key="a" * 16) is None
    for path in ("/health", "/metrics", "/version"):
        assert _check(s, path=path, host="localhost") is None
    assert _check(s, path="/tokenize", host="localhost").status == 401
    assert _check(s, path="/kvscope/telemetry", host="localhost").status == 401
