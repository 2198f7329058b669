"""The OpenAI-compatible HTTP server (`engine serve`): app, protocol, text streaming, Prometheus metrics."""
