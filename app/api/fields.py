"""Reading one field of a request body: its type and range checked, a 400 naming the field and
the allowed values otherwise (errors.bad_request)."""

from __future__ import annotations

import math
from typing import Any

from app.api.errors import bad_request

MAX_STOP_STRINGS = 16


def stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if (
        not isinstance(stop, list)
        or not all(isinstance(s, str) and s for s in stop)
        or len(stop) > MAX_STOP_STRINGS
    ):
        raise bad_request(
            f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} "
            "non-empty strings",
            "stop",
        )
    return stop


def logit_bias(body: dict[str, Any]) -> dict[int, float]:
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise bad_request("logit_bias must be an object {token id: bias}", "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if token < 0 or (isinstance(key, str) and not key.strip().isdigit()):
            raise bad_request(f"logit_bias keys must be token ids (integers >= 0), got {key!r}",
                              "logit_bias")  # fmt: skip
        if not is_number(value) or not -100 <= value <= 100:
            raise bad_request(f"logit_bias values must be numbers in [-100, 100], got {value!r}",
                              "logit_bias")  # fmt: skip
        out[token] = float(value)
    return out


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def int_field(
    body: dict[str, Any],
    name: str,
    low: int,
    high: int,
    default: int | None = None,
    note: str = "",
) -> int:
    value = body.get(name)
    if value is None and default is not None:
        return default
    if not is_int(value) or not low <= value <= high:
        raise bad_request(
            f"{name} must be an integer in [{low}, {high}]{note}, got {value!r}", name
        )
    return value


def float_field(
    body: dict[str, Any],
    name: str,
    low: float,
    high: float,
    default: float,
    low_open: bool = False,
) -> float:
    value = body.get(name)
    if value is None:
        return default
    ok = is_number(value) and (low < value if low_open else low <= value) and value <= high
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise bad_request(f"{name} must be a number in {interval}, got {value!r}", name)
    return float(value)


def bool_field(body: dict[str, Any], name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{param or name} must be true or false, got {value!r}", param or name)
    return value
