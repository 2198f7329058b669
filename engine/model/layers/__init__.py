"""Building blocks the model families are assembled from: norms, rotary embeddings, attention, MoE."""
