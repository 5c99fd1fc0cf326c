"""The engine process with the default model (SmolLM2-135M GGUF) against the in-process engine,
the terminal chat, and a clean stop on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from engine_proc import SamplingParams
from ipc import protocol as P
from ipc.client import EngineClient
from tests.ipc.helpers import REPO, EngineProc

pytestmark = pytest.mark.slow

NUM_BLOCKS = 128
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine_and_reference(request):
    import torch

    threads = torch.get_num_threads()  # the reference engine sets 1; restore it for later tests
    proc = EngineProc(["--num-blocks", str(NUM_BLOCKS), "--num-threads", "1"], wait=False)
    try:
        # Load the reference (the session's shared default checkpoint, tests/conftest.py) while
        # the engine process loads its own copy.
        make = request.getfixturevalue("default_engine_factory")
        reference = make(num_kv_blocks=NUM_BLOCKS, device="cpu", num_threads=1)
        proc.wait_ready(600)
        yield proc, reference
    finally:
        proc.stop()
        torch.set_num_threads(threads)


def test_chat_equals_in_process_greedy(engine_and_reference) -> None:
    proc, reference = engine_and_reference
    with EngineClient(proc.endpoint) as client:
        assert client.model_info.num_layers == 30 and client.model_info.num_kv_heads == 3
        assert client.model_info.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4
        # The engine process generates while this process computes the reference.
        stream = client.chat(MESSAGES, max_tokens=10, temperature=0.0)
        params = SamplingParams(max_tokens=10, temperature=0.0)
        expected = reference.generate([MESSAGES], params)[0]
        deltas = [ev for ev in stream if isinstance(ev, P.Delta)]
    assert stream.token_ids == expected.token_ids
    assert stream.text == expected.text and "".join(d.text for d in deltas) == expected.text
    assert stream.finish.reason == expected.finish_reason
    assert stream.finish.usage.prompt_tokens == expected.num_prompt_tokens


def test_terminal_chat_keeps_the_conversation(engine_and_reference) -> None:
    proc, _ = engine_and_reference
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.chat",
            "--connect",
            proc.endpoint,
            "--temperature",
            "0",
            "--max-tokens",
            "6",
        ],
        input="My name is Ann.\nWhat is my name?\n/quit\n",
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("assistant> ") == 2
    stats = [tuple(map(int, m)) for m in re.findall(r"\[prompt (\d+) \(cached (\d+)\)", r.stdout)]
    assert len(stats) == 2
    (p1, _), (p2, c2) = stats
    # Turn 2 carries turn 1 (question + reply) in its prompt, and hits turn 1's cached blocks.
    assert p2 > p1 + 6
    assert c2 >= 16


def test_sigterm_aborts_in_flight_and_exits_0(engine_and_reference) -> None:
    proc, _ = engine_and_reference
    client = EngineClient(proc.endpoint)
    try:
        stream = client.chat(MESSAGES, max_tokens=200, temperature=0.0, ignore_eos=True)
        assert isinstance(next(stream), P.Delta)
        proc.proc.send_signal(signal.SIGTERM)
        stream.result(60)
        assert stream.finish.reason == "abort"
        assert "SIGTERM" in stream.finish.error
        assert proc.proc.wait(60) == 0
    finally:
        client.close()
