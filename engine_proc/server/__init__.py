"""The engine process: the ZeroMQ socket loop (`EngineServer`), its clients and requests,
live control, telemetry and KV-event publishing, the disaggregation role, conversion of engine
objects to wire messages, and the command line (`python -m engine_proc serve`)."""
