"""What the parity tests of the MLA families (DeepSeek-V3, GLM 5.2's sparse attention) share: a small random
model saved by transformers with its greedy continuations, and the engine on the same folder."""
from __future__ import annotations

import torch

MAX_TOKENS = 8


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).norm() / reference.norm())


def saved_reference(model, folder, vocab_size: int, prompt_lengths: tuple[int, ...]):
    """Widens the model's weights (std 0.15: every expert choice and every head changes the logits), gives its
    MoE layers (all but the first) a non-zero correction bias, saves it to `folder`, and returns (folder, model,
    prompts of the given lengths, transformers' greedy continuations of MAX_TOKENS)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.15)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, vocab_size, (n,), generator=generator).tolist() for n in prompt_lengths]
    with torch.no_grad():
        expected = [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    return folder, model, prompts, expected


def engine(folder, **overrides):
    from engine.llm import LLM

    return LLM(**{"model": str(folder), "kv_dtype": "fp32", "page_size": 8, "num_pages": 128, **overrides})


def greedy(llm, prompts):
    from engine.core.sequence import SamplingParams

    return [out.token_ids for out in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]
