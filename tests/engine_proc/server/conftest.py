"""One engine process (tiny random Llama) for the server test modules that drive it over ZeroMQ
(package scope: started once), and the in-process reference engine built while it starts."""

from __future__ import annotations

import pytest

from ipc.client import EngineClient
from tests.engine_proc.server.engine_process import _REFERENCE, NUM_BLOCKS
from tests.ipc.helpers import TINY, EngineProc


@pytest.fixture(scope="package")
def engine():
    proc = EngineProc(
        TINY
        + [
            "--num-blocks",
            str(NUM_BLOCKS),
            "--telemetry-hz",
            "20",
            "--client-timeout",
            "5",
            "--heartbeat-interval",
            "0.5",
        ],
        wait=False,
    )
    try:
        from tests.engine_fixtures import tiny_engine

        # Build the in-process reference while the engine process starts.
        _REFERENCE[:] = [
            tiny_engine(num_kv_blocks=NUM_BLOCKS, attention_backend="torch", device="cpu")
        ]
        proc.wait_ready(300)
        yield proc
    finally:
        rc = proc.stop()
    assert rc == 0, proc.log()


@pytest.fixture(scope="package")
def reference(engine):
    return _REFERENCE[0]


@pytest.fixture()
def client(engine):
    c = EngineClient(engine.endpoint, client_name="test")
    yield c
    c.close()
