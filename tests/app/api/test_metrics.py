"""app/api/metrics.py: telemetry -> Prometheus text, read back with prometheus_client's parser."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from app.api.metrics import render
from ipc import protocol as P


def _telemetry() -> P.Telemetry:
    blocks = {k: np.zeros(4, dtype=v) for k, v in P.BLOCK_DTYPES.items()}
    return P.Telemetry(
        seq=1, time=0.0,
        counters={"num_requests_running": 2, "num_requests_waiting": 1,
                  "kv_cache_usage_perc": 0.25, "prefix_cache_queries": 40,
                  "prefix_cache_hits": 16, "request_prompt_tokens_total": 40,
                  "generation_tokens_total": 9, "num_blocks_in_use": 1, "num_blocks_cached": 2,
                  "num_blocks_empty": 1},
        config=P.LiveConfig(max_num_seqs=4, max_num_batched_tokens=64, long_prefill_chunk=0,
                            enable_prefix_caching=True),
        blocks=P.BlockArrays.pack(**blocks), requests=[],
        histograms={"time_to_first_token_seconds": P.Histogram(
            bounds=[0.1, 1.0], counts=[2, 0, 1], sum=5.3)},
        finished_reasons={"stop": 2, "length": 1},
    )  # fmt: skip


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_rendered_metrics_parse_with_cumulative_buckets_and_vllm_names() -> None:
    info = SimpleNamespace(block_size=16, num_blocks=4, dtype="float32", kv_bytes_per_token=8,
                           device="cpu")  # fmt: skip
    text = render(SimpleNamespace(telemetry=_telemetry(), model_info=info), "m").decode()
    s = _samples(text)
    e = (("engine", "0"),)
    assert s[("kvscope:num_requests_running", e)] == 2
    assert s[("kvscope:gpu_cache_usage_perc", e)] == 0.25
    assert s[("kvscope:prefix_cache_hits_total", e)] == 16
    assert s[("kvscope:prompt_tokens_total", e)] == 40
    assert s[("kvscope:generation_tokens_total", e)] == 9
    assert s[("kvscope:request_success_total", (*e, ("finished_reason", "stop")))] == 2
    assert s[("kvscope:request_success_total", (*e, ("finished_reason", "abort")))] == 0
    bucket = "kvscope:time_to_first_token_seconds_bucket"
    assert [s[(bucket, (*e, ("le", le)))] for le in ("0.1", "1.0", "+Inf")] == [2, 2, 3]
    assert s[("kvscope:time_to_first_token_seconds_count", e)] == 3
    assert s[("kvscope:time_to_first_token_seconds_sum", e)] == 5.3
    assert s[("kvscope:kv_blocks", (*e, ("state", "cached")))] == 2
    assert 'model_name="m"' in text


def test_nothing_before_the_first_snapshot() -> None:
    info = SimpleNamespace()
    assert render(SimpleNamespace(telemetry=None, model_info=info), "m") == b""


def test_kv_tier_metrics_appear_only_with_tiers() -> None:
    info = SimpleNamespace(block_size=16, num_blocks=4, dtype="float32", kv_bytes_per_token=8,
                           device="cpu")  # fmt: skip
    tel = _telemetry()
    plain = _samples(render(SimpleNamespace(telemetry=tel, model_info=info), "m").decode())
    assert not any(name.startswith("kvscope:kv_tier") for name, _ in plain)
    tel.counters.update(
        {
            "kv_host_blocks_total": 8,
            "kv_host_blocks": 3,
            "kv_host_hits": 5,
            "kv_disk_blocks_total": 100,
            "kv_disk_blocks": 7,
            "kv_disk_hits": 2,
            "external_prefix_cache_queries": 64,
            "external_prefix_cache_hits": 48,
        }
    )
    s = _samples(render(SimpleNamespace(telemetry=tel, model_info=info), "m").decode())
    e = (("engine", "0"),)
    assert s[("kvscope:kv_tier_blocks", (*e, ("tier", "host")))] == 3
    assert s[("kvscope:kv_tier_hits_total", (*e, ("tier", "disk")))] == 2
    assert s[("kvscope:external_prefix_cache_hits_total", e)] == 48


def test_spec_decode_counters_under_vllm_names() -> None:
    info = SimpleNamespace(block_size=16, num_blocks=4, dtype="float32", kv_bytes_per_token=8,
                           device="cpu")  # fmt: skip
    tel = _telemetry()
    plain = _samples(render(SimpleNamespace(telemetry=tel, model_info=info), "m").decode())
    assert not any(name.startswith("kvscope:spec_decode") for name, _ in plain)
    tel.counters.update({"spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 40,
                         "spec_decode_num_accepted_tokens": 25,
                         "spec_decode_num_accepted_tokens_per_pos:0": 9,
                         "spec_decode_num_accepted_tokens_per_pos:1": 16 - 9})  # fmt: skip
    s = _samples(render(SimpleNamespace(telemetry=tel, model_info=info), "m").decode())
    e = (("engine", "0"),)
    assert s[("kvscope:spec_decode_num_drafts_total", e)] == 10
    assert s[("kvscope:spec_decode_num_draft_tokens_total", e)] == 40
    assert s[("kvscope:spec_decode_num_accepted_tokens_total", e)] == 25
    per_pos = "kvscope:spec_decode_num_accepted_tokens_per_pos_total"
    assert s[(per_pos, (*e, ("position", "0")))] == 9
    assert s[(per_pos, (*e, ("position", "1")))] == 7
