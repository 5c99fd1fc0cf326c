"""The model catalog: models found where people keep them (stores.py), what each one is and
whether the engine runs it (inspect.py, from headers and config.json only, no tensors read), and
how much memory it needs at a chosen context and KV type (estimate.py). No torch on this path:
`python -m engine_proc models` (cli.py) answers in well under a second."""
