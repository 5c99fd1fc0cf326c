"""Architecture hyper-parameters of a decoder-only model, from config.json or GGUF metadata.

Every family (engine_proc/models/registry.py) maps onto this one description; the forward pass
(engine_proc/models/llama.py) reads the features a family turns on: q/k norms (Qwen3, Gemma 3),
sliding-window layers (Mistral, Phi-3, Gemma 2/3), Gemma's sandwich norms, scaled embeddings
and GELU-tanh MLP, Gemma 2's soft-capping, Phi's partial rotary and LongRoPE tables, routed
experts in place of the MLP (Qwen3-MoE, Mixtral: models/moe.py)."""

from __future__ import annotations

from dataclasses import dataclass

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
HIDDEN_ACTS = ("silu", "gelu_tanh")


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
    # llama3: factor, low/high_freq_factor, original_max_position_embeddings; linear: factor;
    # longrope: short_factor, long_factor (tuples), original_max_position_embeddings,
    # attention_factor (see layers.longrope_tables)
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qk_norm: bool = False  # per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3)
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    layer_types: tuple[str, ...] = ()  # per layer, from LAYER_TYPES; () = all full attention
    rope_local_theta: float | None = None  # rotary base of sliding layers (Gemma 3); None: same
    sandwich_norms: bool = False  # Gemma: norms after attention and around the MLP as well
    hidden_act: str = "silu"  # of the gated MLP, from HIDDEN_ACTS
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    query_scale: float | None = None  # attention scale; None: head_dim ** -0.5
    # Routed experts (Qwen3-MoE, Mixtral): 0 = a dense MLP in every layer
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts a token is routed to
    moe_intermediate_size: int = 0  # each expert's MLP width (intermediate_size: dense layers')
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to 1
    dense_mlp_layers: tuple[int, ...] = ()  # layers of an expert model with a dense MLP
    rotary_dim: int | None = None  # rotary on the first rotary_dim of each head (Phi-4-mini)
    attn_logit_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: logits = cap * tanh(logits / cap)

    def __post_init__(self) -> None:
        assert not self.layer_types or len(self.layer_types) == self.num_layers, self.layer_types
        assert all(t in LAYER_TYPES for t in self.layer_types), self.layer_types
        assert self.hidden_act in HIDDEN_ACTS, self.hidden_act
        assert SLIDING_ATTENTION not in self.layer_types or self.sliding_window, self.sliding_window
        assert not self.num_experts or 0 < self.num_experts_per_tok <= self.num_experts
        rotary = self.rotary_dim
        assert rotary is None or (0 < rotary < self.head_dim and rotary % 2 == 0), rotary

    def layer_has_experts(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    @property
    def has_experts(self) -> bool:
        return any(self.layer_has_experts(i) for i in range(self.num_layers))

    @property
    def rope_dim(self) -> int:
        """How many leading dimensions of each head the rotary embedding turns."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def layer_window(self, layer: int) -> int | None:
        """How many keys (up to and including its own position) a query of this layer sees;
        None: all of them (full attention)."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def has_sliding_layers(self) -> bool:
        return SLIDING_ATTENTION in self.layer_types

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def longrope_original(config: ModelConfig) -> int | None:
    """LongRoPE's original_max_position_embeddings (Phi-3), past which a sequence rotates with
    the long factors; None for other rotary embeddings."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return None
    return int(scaling["original_max_position_embeddings"])
