import atexit
import gc
import os
import shutil
import tempfile

import pytest

# The engine caches converted tokenizers under ~/.cache/kvscope; the suite (and the engine
# processes it spawns, which inherit this) uses a cache of its own, emptied with the temp dir.
if "KVSCOPE_CACHE_DIR" not in os.environ:
    os.environ["KVSCOPE_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvscope-test-cache-")
    atexit.register(shutil.rmtree, os.environ["KVSCOPE_CACHE_DIR"], ignore_errors=True)

# pytest-xdist runs one worker per core: each worker's torch (and the engines it spawns) would
# start a thread per core as well, and threads spinning past the cores slowed the suite by a
# third (tests/engine_proc/models on 2 cores: 128 s -> 89 s with one thread per worker). A test
# that wants more threads sets them itself.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _workers > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers))

# Triton decides between compiled and interpreted kernels at import: without a GPU the kernels
# run on CPU tensors through the interpreter.
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass


@pytest.fixture(autouse=True)
def collect_cycles_on_the_main_thread():
    """Once a GUI test has turned automatic collection off (tests/ui/conftest.py), the tests
    after it in this worker collect here, on the main thread, by the usual thresholds."""
    yield
    if not gc.isenabled():
        from ui.qt_compat import collect_garbage_on_gui_thread

        collect_garbage_on_gui_thread().check()


@pytest.fixture(scope="session")
def default_checkpoint():
    """The default SmolLM2 model in float32, loaded once for every test that needs it."""
    import torch

    from engine_proc.loading.loader import load_checkpoint

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

    from engine_proc.loading.loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_default_model):
    from tests.engine_fixtures import greedy_reference

    return greedy_reference(hf_default_model)


@pytest.fixture(scope="session")
def parity_references(request, default_engine_factory):
    """tests/engine_proc/engine/test_hf_parity.py's prompts as token ids, with transformers'
    greedy replies to them (PARITY_TOKENS tokens at most, ending at EOS): computed once per
    suite run (the suite's cache dir, shared by pytest-xdist's workers: the first computes them,
    the others wait and read), for every test comparing the default model's replies with the
    dense reference."""
    import json
    from pathlib import Path

    from filelock import FileLock

    from tests.engine_proc.engine.test_hf_parity import PARITY_TOKENS, PROMPTS

    path = Path(os.environ["KVSCOPE_CACHE_DIR"]) / "parity_references.json"
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            engine = default_engine_factory(dtype="float32")
            ids = [engine.tokenize(p) for p in PROMPTS]
            hf_greedy = request.getfixturevalue("hf_greedy")
            path.write_text(json.dumps([ids, [hf_greedy(i, PARITY_TOKENS) for i in ids]]))
        ids, replies = json.loads(path.read_text())
    return ids, replies


@pytest.fixture(params=[False, True], ids=["emulated-bf16", "native-bf16"])
def native_bf16(request, monkeypatch):
    """Both bf16 arithmetics of the model on any CPU: engines built in the test see this value
    instead of the CPU's flags (models.layers.cpu_has_native_bf16), which decide whether bf16
    products of more than 2 rows run upcast to float32 and up to how many rows the int4 mode's
    bf16 output projection is used."""
    from engine_proc.models import layers

    monkeypatch.setattr(layers, "cpu_has_native_bf16", lambda: request.param)
    return request.param


@pytest.fixture(scope="session")
def tiny_dir():
    """A tiny random Llama with the default model's real tokenizer and chat template."""
    from tests.tiny_models import tiny_model_dir

    return tiny_model_dir("llama", num_layers=2, max_position_embeddings=512)


@pytest.fixture(scope="session")
def server(tiny_dir):
    """One `python -m app serve` process for the HTTP tests (tests/api, tests/remote): the tiny
    model, dense float32 weights, an API key, a served model name."""
    from tests.app.api.helpers import API_KEY, MODEL, NUM_BLOCKS, ServeProc

    proc = ServeProc(
        [
            "--port", "0", "--model", str(tiny_dir), "--dtype", "float32",
            "--decode-weights", "dense", "--api-key", API_KEY, "--served-model-name", MODEL,
            "--engine-args", f"--num-threads 1 --num-kv-blocks {NUM_BLOCKS} --telemetry-hz 50",
        ]
    )  # fmt: skip
    try:
        yield proc.wait_healthy()
    finally:
        proc.stop()


@pytest.fixture()
def sdk(server):
    import openai

    from tests.app.api.helpers import API_KEY

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture()
def async_sdk(server):
    import openai

    from tests.app.api.helpers import API_KEY

    return openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def extension():
    """The fused decode step's compiled extension (built once into the suite's cache dir), or a
    skip where this machine cannot build it (like the CUDA tests: the engine says so)."""
    from engine_proc.executor import fused_build
    from tests.engine_proc.executor import extension_builds

    return extension_builds.build(fused_build.NATIVE_ARCH)
