"""Running the model for one scheduled step: the model runner (flat batch, slot mapping,
block tables), the sampler, CUDA graphs on GPUs and the fused C++ decode step on CPUs (its
wiring, its output projection and its build; the C++ is in engine_proc/native/)."""
