"""The benchmark's engine-side workers (`app.bench` spawns them): KVScope, transformers and
llama.cpp on the same workload, the kernel timings (`python -m engine_proc.bench.kernels`) and
the KV quantisation accuracy check (`python -m engine_proc.bench.kv_quant_eval`)."""
