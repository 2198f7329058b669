"""Serving benchmark results (vLLM, SGLang, guidellm, CSV): read, replayed and fitted."""
