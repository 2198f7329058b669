"""Torch-free heart of the engine: model spec and config parsing, byte arithmetic, sequences, the block
manager, the scheduler, profile format and latency metrics. The planner imports only this room of the engine."""
