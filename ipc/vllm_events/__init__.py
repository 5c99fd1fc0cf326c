"""KV cache events in vLLM's wire format (what vLLM's and SGLang's `--kv-events-config`
publishers send and KV-aware routers consume), both ways: KVScope's engine publishes them and the
window subscribes to any publisher of them. docs/PROTOCOL.md, "KV events in vLLM's format".

`events.py` is the decoded, normalised form both sides share; no torch, no Qt here.
"""
