"""A paged-KV inference engine for Llama-family models: the ground truth the planner is calibrated on."""
