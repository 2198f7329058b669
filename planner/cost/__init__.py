"""A deployment's cost per step and per byte: memory plan, step-time model, collectives."""
