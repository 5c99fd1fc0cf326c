"""Tiny random Llama / Qwen2 checkpoints for tests, built with transformers and cached per session.

    from tests.tiny_models import tiny_model_dir, tiny_gguf_file, hf_reference_model

    path = tiny_model_dir("qwen2", num_heads=4, num_kv_heads=1)   # HF dir: config + safetensors
    ref = hf_reference_model(path)                               # transformers model, eval mode
    gguf_path = tiny_gguf_file("llama")                          # same weights as a llama.cpp GGUF

Every model uses the default SmolLM2 tokenizer (vocab 49152, chat template, bos 1, eos 2), so
prompts and chat messages work as with the real model; hidden size 64 and 2 layers keep each
checkpoint at a few MB. Weights are seeded and scaled so attention is far from uniform (a
bug in positions or masking changes the logits) and greedy next tokens are well separated.

The modules: session.py (the session's cache directory and the shared tokenizer), dense.py (HF
checkpoint directories of the dense families), phi_gemma2.py (Phi-3 and Gemma 2 configs), moe.py
(Qwen3-MoE and Mixtral), gguf_files.py (the same weights as llama.cpp GGUF files).
"""

from tests.tiny_models.dense import (
    ARCHITECTURES,
    LLAMA3_ROPE_SCALING,
    hf_reference_model,
    tiny_model_dir,
    with_chat_template,
)
from tests.tiny_models.gguf_files import tiny_gguf_file, tiny_moe_gguf_file
from tests.tiny_models.moe import MOE_ARCHITECTURES, tiny_moe_model_dir
from tests.tiny_models.phi_gemma2 import PHI_GEMMA2_ARCHITECTURES, phi3_longrope
from tests.tiny_models.session import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    TOKENIZER_VOCAB_SIZE,
    tiny_tokenizer_dir,
)

__all__ = [
    "ARCHITECTURES",
    "BOS_TOKEN_ID",
    "EOS_TOKEN_ID",
    "LLAMA3_ROPE_SCALING",
    "MOE_ARCHITECTURES",
    "PHI_GEMMA2_ARCHITECTURES",
    "TOKENIZER_VOCAB_SIZE",
    "hf_reference_model",
    "phi3_longrope",
    "tiny_gguf_file",
    "tiny_model_dir",
    "tiny_moe_gguf_file",
    "tiny_moe_model_dir",
    "tiny_tokenizer_dir",
    "with_chat_template",
]
