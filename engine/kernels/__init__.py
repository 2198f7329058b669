"""Triton kernels of the engine, each beside a pure-torch reference that it is tested against."""
