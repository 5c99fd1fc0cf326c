"""Watching a server over HTTP: the remote link and its chats, /metrics charts and history,
the aggregate KV panel, and a disaggregated KVScope deployment's two telemetry streams."""
