"""One rank's network: layers, architectures, the paged KV cache, attention, quantization, loading."""
