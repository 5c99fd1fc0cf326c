"""The KVScope engine: a small vLLM-style serving engine for Llama-family models."""

from engine_proc.config import EngineConfig
from engine_proc.outputs import RequestMetrics, RequestOutput
from engine_proc.sampling_params import SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "RequestMetrics", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):  # torch loads only when the engine itself is asked for
    if name == "LLMEngine":
        from engine_proc.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
