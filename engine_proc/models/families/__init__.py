"""One file per architecture family: what its config.json and GGUF metadata say, as ModelConfig
fields (engine_proc/models/registry.py Family)."""
