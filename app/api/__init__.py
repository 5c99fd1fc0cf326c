"""The OpenAI-compatible HTTP front-end (`kvscope serve`): one more client of the engine.

It runs in its own process (or beside the window as a child of the GUI), talks to the engine over
the ZeroMQ protocol like every other client, and never imports torch or Qt:

    errors.py     OpenAI error bodies and status codes
    requests.py   request bodies -> validated generation plans (400 naming the field)
    responses.py  engine replies -> OpenAI response objects and stream chunks
    metrics.py    telemetry snapshots -> Prometheus text (vLLM's names, `kvscope:` prefix)
    server.py     the ASGI app: security, limits, routes, disconnects
    serve.py      `kvscope serve` / `python -m app serve`: spawn or attach, then serve
"""
