"""The forward pass: the Llama-family model over a paged KV cache, its config, and 4-bit
decode weights."""
