"""Architecture hyper-parameters of a Llama-family model, from config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2)
    rope_scaling: dict | None = None  # llama3-style: factor, low/high_freq_factor, original_max...
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
