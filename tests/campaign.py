"""The fault campaign's assertion, shared by the Llama and the MLA integrity tests."""
from __future__ import annotations

import random

from engine.harness.fault_campaign import run_trial
from engine.llm import LLM


def assert_campaign_detects(llm: LLM, workload, kinds, trials: int, seed: int, rank: int = 0) -> None:
    prompts, params = workload
    reference = [r.token_ids for r in llm.generate(prompts, params)]
    rng = random.Random(seed)
    for kind in kinds:
        for trial in range(trials):
            result = run_trial(llm, prompts, params, reference, kind, rng, rank=rank)
            where = f"{kind} trial {trial} ({result.fault})"
            assert result.fault is not None, where
            assert result.detected, f"not detected: {where}"
            assert result.victims_clean, f"a victim got a token after the fault: {where}"
            assert result.harmed == 0, f"{result.harmed} other requests harmed: {where}"
            assert result.leaked_pages == 0, f"{result.leaked_pages} pages leaked: {where}"
    llm.core.block_manager.check_invariants()
