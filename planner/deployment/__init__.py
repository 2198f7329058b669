"""A deployment evaluated: capacity, throughput, cost and its simulation."""
