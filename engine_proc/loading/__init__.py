"""From a file on disk to weights, a model config and a tokenizer: local Hugging Face
directories (safetensors) and GGUF files (llama.cpp's block formats dequantized), the checkpoint
they make, and the tokenizer cache for GGUFs."""
