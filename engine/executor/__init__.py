"""One step on the model: step plans, the runner, sampling, integrity checks, worker ranks and fault hooks."""
