"""Endpoint defaults and the loopback-only rule for what the engine may bind.

Allowed without `--allow-remote`:
- `tcp://127.x.x.x:<port|*>`, `tcp://[::1]:<port|*>`, `tcp://localhost:<port|*>`
- `ipc://<path>` whose directory is owned by this user and closed to group and others (0700)
- `ipc://auto` (a fresh private 0700 runtime directory), `inproc://<name>`
Anything else (0.0.0.0, `*`, an interface name, a public address, other transports) needs
`allow_remote=True` and an access token of at least MIN_TOKEN_LENGTH characters.
"""

from __future__ import annotations

import ipaddress
import os
import stat
import tempfile

DEFAULT_ENDPOINT = "tcp://127.0.0.1:*"  # "*" = a free port; the ready line names the real one
DEFAULT_PUB_ENDPOINT = "tcp://127.0.0.1:*"
AUTO_IPC = "ipc://auto"
MIN_TOKEN_LENGTH = 16


def is_loopback(endpoint: str) -> bool:
    """True for endpoints only this machine (and, for ipc://, only this user) can reach."""
    if endpoint.startswith("inproc://") or endpoint == AUTO_IPC:
        return True
    if endpoint.startswith("ipc://"):
        return _private_dir(os.path.dirname(os.path.abspath(endpoint[len("ipc://") :])))
    if not endpoint.startswith("tcp://"):
        return False
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not port or ";" in host:  # "src;dst" forms bind nothing we can vouch for
        return False
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", interface names, host names


def check_bind(endpoint: str, allow_remote: bool, token: str | None) -> None:
    """Raise ValueError unless the engine may bind `endpoint`."""
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise ValueError(
            f"endpoint must look like tcp://127.0.0.1:PORT or ipc://PATH, got {endpoint!r}"
        )
    if is_loopback(endpoint):
        return
    if not allow_remote:
        raise ValueError(
            f"refusing to bind {endpoint!r}: only loopback tcp (127.0.0.1, [::1], localhost) "
            "or ipc:// in a private 0700 directory are allowed without --allow-remote and --token"
        )
    if not token or len(token) < MIN_TOKEN_LENGTH:
        raise ValueError(
            f"binding {endpoint!r} needs --token with at least {MIN_TOKEN_LENGTH} characters"
        )


def private_runtime_dir() -> str:
    """A fresh 0700 directory for ipc:// sockets, under $XDG_RUNTIME_DIR when it exists."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.path.isdir(base):
        base = None
    path = tempfile.mkdtemp(prefix="kvscope-", dir=base)  # mkdtemp creates it 0700
    assert _private_dir(path)
    return path


def resolve_auto(endpoint: str, runtime_dir: str | None, name: str) -> tuple[str, str | None]:
    """Turn `ipc://auto` into `ipc://<private dir>/<name>`; returns (endpoint, dir used)."""
    if endpoint != AUTO_IPC:
        return endpoint, runtime_dir
    if runtime_dir is None:
        runtime_dir = private_runtime_dir()
    return f"ipc://{os.path.join(runtime_dir, name)}", runtime_dir


def connect_address(bound: str) -> str:
    """What a client connects to for a bound endpoint (ZMQ reports 0.0.0.0 for wildcards)."""
    return bound.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")


def _private_dir(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (
        stat.S_ISDIR(st.st_mode)
        and st.st_uid == os.getuid()
        and (st.st_mode & (stat.S_IRWXG | stat.S_IRWXO)) == 0
    )
