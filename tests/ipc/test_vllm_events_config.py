"""--kv-events-config (ipc/vllm_events/config.py): vLLM's KVEventsConfig JSON, its defaults,
the errors a bad value gets, and vLLM's endpoint rules (data-parallel port offset, bind or
connect)."""

from __future__ import annotations

import argparse

import pytest

from ipc.vllm_events.config import (
    KVEventsConfig,
    kv_events_config_arg,
    offset_endpoint_port,
    parse_kv_events_config,
    pub_binds,
)


def test_defaults_are_vllms():
    cfg = parse_kv_events_config("{}")
    assert cfg == KVEventsConfig()
    assert (cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps, cfg.hwm, cfg.max_queue_size,
            cfg.topic) == ("tcp://*:5557", None, 10_000, 100_000, 100_000, "")  # fmt: skip
    assert (cfg.encoding, cfg.hash_type) == ("map", "int")
    assert cfg.publisher == "null" and not cfg.active


def test_enabling_events_picks_the_zmq_publisher_as_vllm_does():
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert cfg.publisher == "zmq" and cfg.active
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}')
    assert not cfg.active
    assert not parse_kv_events_config('{"publisher": "zmq"}').active  # not enabled: nothing


def test_every_key_is_taken():
    cfg = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6000", '
        '"replay_endpoint": "tcp://*:6001", "buffer_steps": 5, "hwm": 7, "max_queue_size": 9, '
        '"topic": "kv-events", "encoding": "array", "hash_type": "bytes"}'
    )
    assert cfg.replay_endpoint == "tcp://*:6001" and cfg.buffer_steps == 5 and cfg.hwm == 7
    assert (cfg.topic, cfg.encoding, cfg.hash_type) == ("kv-events", "array", "bytes")


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"enable_kv_events": true}', ["enable_kv_events", "enable_kv_cache_events", "topic"]),
        ('{"enable_kv_cache_events": 1}', ["enable_kv_cache_events", "true or false"]),
        ('{"publisher": "kafka"}', ["publisher", "'zmq'", "'null'"]),
        ('{"encoding": "json"}', ["encoding", "'map'", "'array'"]),
        ('{"hash_type": "hex"}', ["hash_type", "'int'", "'bytes'"]),
        ('{"buffer_steps": 0}', ["buffer_steps", ">= 1"]),
        ('{"hwm": true}', ["hwm", "integer"]),
        ('{"hwm": 1.5}', ["hwm", "integer"]),
        ('{"endpoint": "5557"}', ["endpoint", "ZeroMQ endpoint"]),
        ('{"topic": 3}', ["topic", "string"]),
        ("[1, 2]", ["JSON object"]),
        ("{enable: true}", ["not valid JSON"]),
    ],
)
def test_a_bad_value_names_the_key_and_what_it_takes(text, words):
    with pytest.raises(ValueError) as err:
        parse_kv_events_config(text)
    for w in words:
        assert w in str(err.value)


def test_the_argparse_type_turns_errors_into_usage_errors():
    parser = argparse.ArgumentParser(prog="serve", exit_on_error=False)
    parser.add_argument("--kv-events-config", type=kv_events_config_arg)
    with pytest.raises(argparse.ArgumentError) as err:
        parser.parse_args(["--kv-events-config", '{"hwm": -1}'])
    assert "--kv-events-config" in str(err.value) and "hwm" in str(err.value)


def test_data_parallel_rank_offsets_the_port_as_vllm_does():
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("tcp://10.0.0.1:5558", 1) == "tcp://10.0.0.1:5559"
    assert offset_endpoint_port("inproc://cache", 2) == "inproc://cache_dp2"
    assert offset_endpoint_port(None, 2) is None
    with pytest.raises(ValueError):
        offset_endpoint_port("ipc:///tmp/kv", 1)


def test_wildcards_and_local_transports_bind_others_connect():
    for ep in ("tcp://*:5557", "tcp://127.0.0.1:*", "tcp://[::]:5557", "ipc:///tmp/x"):
        assert pub_binds(ep), ep
    for ep in ("tcp://127.0.0.1:5557", "tcp://proxy:5557"):
        assert not pub_binds(ep), ep
