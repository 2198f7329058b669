"""The engine on CUDA: Triton paths give the answers of the CPU engine."""
from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sequence import SamplingParams


@pytest.mark.parametrize("weights, kv", [("bf16", "bf16"), ("bf16", "fp8"), ("native", "bf16"), ("fp8", "bf16")])
def test_cuda_engine_answers_chat(weights, kv):
    llm = LLM(model="smollm2-135m", weights=weights, kv_dtype=kv, device="cuda")
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    result = llm.generate([prompt] * 4, SamplingParams(max_tokens=24))
    assert all("Paris" in r.text for r in result)
