"""The engine against Hugging Face transformers loading the same GGUF, in fp32."""
from __future__ import annotations

import pytest
import torch

from engine.core.sequence import SamplingParams

PROMPTS = [
    "The history of the Roman Empire begins with",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "In a paged KV cache, every sequence owns a list of fixed-size blocks, and",
    "Photosynthesis is the process by which green plants",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model(smollm_path):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm_path.parent), gguf_file=smollm_path.name, dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_match_transformers(engine, hf_model, prompt):
    ids = engine.tokenizer.encode(prompt)
    ours = engine.generate([ids], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0].token_ids
    with torch.inference_mode():
        theirs = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(ids):].tolist()
    assert len(ours) == NEW_TOKENS
    assert ours == theirs


@pytest.mark.parametrize("prompt", PROMPTS)
def test_last_position_logits_match_transformers(engine, hf_model, prompt):
    ids = engine.tokenizer.encode(prompt)
    ours = engine.score(ids)[-1]
    with torch.inference_mode():
        theirs = hf_model(torch.tensor([ids])).logits[0, -1].float()
    relative_error = ((ours - theirs).norm() / theirs.norm()).item()
    assert not torch.isnan(ours).any()
    assert relative_error < 1e-3, relative_error
