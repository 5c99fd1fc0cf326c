"""Watching servers other than our own engine process: vLLM, SGLang, llama.cpp's server, or a
KVScope reached over HTTP. Qt-free logic the window's remote link uses (ui/ draws it)."""
