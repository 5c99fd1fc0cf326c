"""`LLMEngine` and its parts: tokenizing requests, one `step()` (schedule, run, sample,
outputs), live control, request metrics and the telemetry snapshot the server publishes."""
