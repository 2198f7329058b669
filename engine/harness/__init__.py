"""What drives an LLM from outside: the profiler, served runs, perplexity and the fault campaign."""
