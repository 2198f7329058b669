"""A paged-KV inference engine (Llama, DeepSeek-V3 / Kimi, GLM 5.2) on CPU and NVIDIA GPUs: the ground truth the
planner is calibrated on. The rooms, lowest first: core, kernels, parallel, model, executor, llm, server and
harness, cli (docs/architecture.md)."""
