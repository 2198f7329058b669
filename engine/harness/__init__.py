"""What drives an LLM from outside: the profiler, served runs, perplexity, the fault campaign, servers launched for
tests and benchmarks, and the chaos soak against one."""
