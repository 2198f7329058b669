"""The real engine as a verification runs it: configured as a profile was made, warmed up, fed prompts of the
requested lengths cut from real English text."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.core.reference_text import cut_prompts, reference_ids
from planner.errors import PlannerError

if TYPE_CHECKING:
    from engine.llm import LLM


def english_prompts(tokenizer, lengths: list[int], vocab_size: int, repeating: bool = False) -> list[list[int]]:
    """Prompts of the requested lengths cut one after another from a fixed English text (a model without a
    tokenizer, random weights: from fixed pseudo-random token ids); `repeating`: each its first half said twice,
    as in a request to rewrite given text, where prompt lookup finds what comes next."""
    ids = reference_ids(tokenizer, vocab_size, max(lengths, default=0) * 4)
    try:
        prompts = cut_prompts(ids, [(length + 1) // 2 if repeating else length for length in lengths])
    except ValueError as error:
        raise PlannerError(str(error)) from None
    return [(prompt * 2)[:length] for prompt, length in zip(prompts, lengths)] if repeating else prompts


def engine_of(fingerprint: dict[str, Any], kv_cache_gib: float, **overrides: Any) -> LLM:
    """An engine here configured as the profiled one (model, weights, KV dtype, pages, integrity, threads)."""
    from engine.llm import LLM

    settings = {"model": fingerprint["model_source"], "weights": fingerprint["weights"],
                "kv_dtype": fingerprint["kv_dtype"], "group_size": fingerprint.get("group_size") or 128,
                "device": "cpu", "page_size": fingerprint["page_size"], "kv_cache_gib": kv_cache_gib,
                "integrity": fingerprint.get("integrity", "ownership"), "num_threads": fingerprint.get("threads"),
                "num_layers": fingerprint.get("num_layers"), "num_experts": fingerprint.get("num_experts"),
                "tensor_parallel": fingerprint.get("tensor_parallel", 1),
                "expert_parallel": fingerprint.get("expert_parallel", False)}
    return LLM(**{**settings, **overrides})


def warm_up(llm: LLM, prompt_tokens: int) -> None:
    """One request of the workload's longest prompt through the engine before the clock starts: a fresh
    engine's first steps fault their buffers in, which the profile (timed after a warm-up) never saw and
    a served workload's first prefill, often its only one, would carry."""
    from engine.core.sequence import SamplingParams

    tokens = min(prompt_tokens, llm.config.max_num_batched_tokens, llm.max_model_len - 2)
    vocab = llm.model_config.vocab_size
    llm.generate([[1 + i % (vocab - 1) for i in range(tokens)]], SamplingParams(max_tokens=2, ignore_eos=True))
