"""`kvscope serve --disaggregated`: the HTTP API in front of a spawned prefill and decode engine.

The completion's tokens are checked against transformers' greedy generation of the same
checkpoint; the split is seen in what each engine reports."""

from __future__ import annotations

import httpx
import pytest
import torch

from app.router.router import split_threads
from app.serve import build_parser, check_security
from tests.app.api.helpers import API_KEY, ServeProc
from tests.tiny_models import hf_reference_model


def test_disaggregated_options_are_checked_before_anything_starts():
    def why(*argv: str) -> str | None:
        return check_security(build_parser().parse_args(list(argv)), [])

    assert why("--disaggregated") is None
    assert "not --connect" in why("--disaggregated", "--connect", "tcp://127.0.0.1:5")
    assert "need --disaggregated" in why("--connect-decode", "tcp://127.0.0.1:5")
    assert "--disagg-cores must be >= 2" in why("--disaggregated", "--disagg-cores", "1")
    assert split_threads(2) == (1, 1) and split_threads(5) == (3, 2) and split_threads(1) == (1, 1)


@pytest.mark.slow
def test_serve_disaggregated_answers_with_the_models_greedy_tokens(tiny_dir):
    from transformers import AutoTokenizer

    proc = ServeProc([
        "--port", "0", "--model", str(tiny_dir), "--dtype", "float32", "--decode-weights",
        "dense", "--api-key", API_KEY, "--disaggregated", "--disagg-cores", "2",
        "--engine-args", "--num-kv-blocks 128 --telemetry-hz 50",
    ])  # fmt: skip
    try:
        proc.wait_engines()  # /health is 200 with one engine: the split needs both
        tok = AutoTokenizer.from_pretrained(tiny_dir)
        prompt = list(range(40, 40 + 37))
        r = httpx.post(
            proc.url + "/v1/completions",
            headers={"authorization": f"Bearer {API_KEY}"},
            json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        model = hf_reference_model(tiny_dir)
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 eos_token_id=None, pad_token_id=0)  # fmt: skip
        expected = tok.decode(out[0, len(prompt):].tolist(), skip_special_tokens=True)
        body = r.json()
        assert body["choices"][0]["text"] == expected
        assert body["usage"]["completion_tokens"] == 12
        # Both engines took part: the prefill engine's first token, the decode engine's rest.
        metrics = httpx.get(proc.url + "/metrics",
                            headers={"authorization": f"Bearer {API_KEY}"}, timeout=30).text
        # /metrics shows the decode engine: it sampled 11 of the 12 tokens.
        (line,) = [x for x in metrics.splitlines()
                   if x.startswith("kvscope:generation_tokens_total{")]  # fmt: skip
        assert float(line.rsplit(" ", 1)[1]) == 11
    finally:
        proc.stop()
