"""Deployment search over GPUs, parallelism and dtypes, and the executors that run its simulations."""
