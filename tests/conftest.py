import os

import pytest

# Triton decides between compiled and interpreted kernels at import: without a GPU the kernels
# run on CPU tensors through the interpreter.
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass


@pytest.fixture(scope="session")
def default_checkpoint():
    """The default SmolLM2 model in float32, loaded once for every test that needs it."""
    import torch

    from engine_proc.model_loader import load_checkpoint

    return load_checkpoint(None, torch.float32)


@pytest.fixture(scope="session")
def default_engine_factory(default_checkpoint):
    from engine_proc import EngineConfig, LLMEngine

    def make(**config):
        config.setdefault("num_kv_blocks", 512)
        return LLMEngine(EngineConfig(**config), checkpoint=default_checkpoint)

    return make
