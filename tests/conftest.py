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


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' own model loaded from the same GGUF: the independent reference."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine_proc.model_loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_default_model):
    from tests.engine_fixtures import greedy_reference

    return greedy_reference(hf_default_model)


@pytest.fixture(params=[False, True], ids=["emulated-bf16", "native-bf16"])
def native_bf16(request, monkeypatch):
    """Both bf16 arithmetics of the model on any CPU: engines built in the test see this value
    instead of the CPU's flags (models.llama.cpu_has_native_bf16), which decide whether bf16
    products of more than 2 rows run upcast to float32 and up to how many rows the int4 mode's
    bf16 output projection is used."""
    from engine_proc.models import llama

    monkeypatch.setattr(llama, "cpu_has_native_bf16", lambda: request.param)
    return request.param
