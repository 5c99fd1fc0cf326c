"""app.bench.workloads: the benchmark's workloads (deterministic per seed, shapes that follow the
sizes, the streaming and streams-N workloads) and how workload names expand."""

from __future__ import annotations

import json

import pytest

from app.bench.spec_workloads import SPEC_WORKLOADS
from app.bench.workloads import (
    FULL,
    QUICK,
    STREAMS_WORKLOADS,
    WORKLOAD_SYSTEMS,
    WORKLOADS,
    Vocab,
    default_workloads,
    expand_workloads,
    make_workload,
)

VOCAB = Vocab(49152, list(range(17)))


# The spec workloads serve real text, the same for every seed (tests/app/bench/test_spec.py).
@pytest.mark.parametrize("name", [w for w in WORKLOADS if w not in SPEC_WORKLOADS])
def test_workload_is_deterministic_per_seed(name: str) -> None:
    a = make_workload(name, QUICK, 7, VOCAB)
    b = make_workload(name, QUICK, 7, VOCAB)
    c = make_workload(name, QUICK, 8, VOCAB)
    assert json.dumps(a) == json.dumps(b)
    assert [r["prompt"] for r in a["requests"]] != [r["prompt"] for r in c["requests"]]
    for r in a["requests"]:
        assert all(17 <= t < 49152 for t in r["prompt"])
        assert r["max_tokens"] >= 1


def test_workload_shapes_follow_sizes() -> None:
    s = QUICK
    mixed = make_workload("mixed", s, 0, VOCAB)["requests"]
    poisson = make_workload("mixed-poisson", s, 0, VOCAB)["requests"]
    assert len(mixed) == s.mixed_n
    assert all(s.mixed_prompt[0] <= len(r["prompt"]) <= s.mixed_prompt[1] for r in mixed)
    assert all(s.mixed_out[0] <= r["max_tokens"] <= s.mixed_out[1] for r in mixed)
    assert [r["prompt"] for r in mixed] == [r["prompt"] for r in poisson]
    arrivals = [r["arrival_s"] for r in poisson]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0 and arrivals[-1] > 0
    shared = make_workload("shared-prefix", s, 0, VOCAB)["requests"]
    prefix = shared[0]["prompt"][: s.shared_prefix]
    assert len(shared) == s.shared_n
    assert all(r["prompt"][: s.shared_prefix] == prefix for r in shared)
    assert len({tuple(r["prompt"][s.shared_prefix:]) for r in shared}) == s.shared_n
    single = make_workload("single", s, 0, VOCAB)["requests"]
    assert [(len(r["prompt"]), r["max_tokens"]) for r in single] == [(s.single_prompt,
                                                                     s.single_new)]


@pytest.mark.parametrize("sizes", [QUICK, FULL])
def test_streaming_workload_is_concurrent_streams(sizes) -> None:
    w = make_workload("streaming", sizes, 0, VOCAB)
    reqs = w["requests"]
    assert len(reqs) == sizes.streams_n == 32
    assert all(r["arrival_s"] == 0.0 and "after" not in r for r in reqs)  # all at once
    lo, hi = sizes.streams_prompt
    assert all(lo <= len(r["prompt"]) <= hi for r in reqs) and lo <= 64 <= hi
    assert len({len(r["prompt"]) for r in reqs}) > 1  # drawn, like the mixed workload's
    assert all(r["max_tokens"] == sizes.streams_out for r in reqs)
    assert len({tuple(r["prompt"]) for r in reqs}) == len(reqs)
    assert w["engine"] == {}  # both front-ends get the engine's plain serve options
    warm = w["meta"]["warmup_prompt"]
    assert 0 < len(warm) < 16  # under one KV block: the warm-up leaves no prefix to hit
    assert all(17 <= t < 49152 for t in warm)
    assert FULL.streams_out == 128 and QUICK.streams_out < FULL.streams_out


@pytest.mark.parametrize("sizes", [QUICK, FULL])
def test_streams_workloads_are_n_identical_greedy_streams(sizes) -> None:
    assert STREAMS_WORKLOADS == ("streams-1", "streams-4", "streams-16", "streams-64")
    assert FULL.streams_levels == (1, 4, 16, 64) and QUICK.streams_levels == (1, 4, 16)
    assert FULL.streams_len == 29 and FULL.streams_new == 128 and QUICK.streams_new < 128
    prompts = []
    for n in (1, 4, 16, 64):
        w = make_workload(f"streams-{n}", sizes, 0, VOCAB)
        reqs = w["requests"]
        assert len(reqs) == n == w["meta"]["streams"] == w["hf_batch"]  # hf: one static batch
        assert all(r["arrival_s"] == 0.0 and "after" not in r for r in reqs)  # all at t=0
        assert all(len(r["prompt"]) == sizes.streams_len for r in reqs)
        assert all(r["max_tokens"] == sizes.streams_new for r in reqs)
        assert all("temperature" not in r for r in reqs)  # greedy
        assert len({tuple(r["prompt"]) for r in reqs}) == n
        # the app's CPU defaults, said so: 4-bit decode weights, the fused C++ decode step, its
        # 8-bit arithmetic where our kernels run
        assert w["engine"] == {"decode_weights": "auto", "decode_step": "fused",
                               "decode_activations": "auto"}  # fmt: skip
        assert w["meta"]["decode_activations"] == "auto"
        assert WORKLOAD_SYSTEMS[w["name"]] == ("kvscope", "kvscope-exact", "hf", "llamacpp")
        prompts.append([r["prompt"] for r in reqs])
    for small, large in zip(prompts, prompts[1:], strict=False):
        assert large[: len(small)] == small  # every level serves the smaller levels' prompts


def test_streams_names_expand_with_the_sizes() -> None:
    assert expand_workloads(["streams"], FULL) == list(STREAMS_WORKLOADS)
    assert expand_workloads(["single", "streams", "streams-4"], QUICK) == [
        "single", "streams-1", "streams-4", "streams-16"]
    assert expand_workloads(["streams-64"], QUICK) == ["streams-64"]  # asked for by name
    assert default_workloads(QUICK)[-7:] == ["streams-1", "streams-4", "streams-16",
                                             *SPEC_WORKLOADS]
    assert set(default_workloads(FULL)) == set(WORKLOADS)
    with pytest.raises(ValueError, match="streams-8"):
        expand_workloads(["streams-8"], FULL)
