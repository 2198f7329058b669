"""GLM 5.2's DeepSeek Sparse Attention (`glm_moe_dsa`) against `transformers`' own implementation: same weights
through a saved folder, an `index_topk` far below the prompts, layers that run their own indexer and layers that
share the previous one's selection; alone, chunked, batched and preempted. And the bytes of its caches."""
from __future__ import annotations

import json
import random

import pytest
import torch
import transformers  # a test dependency: a broken install fails here, never skips
from conftest import REPO, engine_cli
from mla_reference import MAX_TOKENS, engine, greedy, relative_error, saved_reference

INDEXER_TYPES = ["full", "shared", "full", "shared", "shared"]
TINY_GLM = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=512, routed_scaling_factor=2.5, index_topk=8,
    index_head_dim=16, index_n_heads=8, indexer_types=INDEXER_TYPES)
PROMPT_LENGTHS = (21, 40, 9, 33, 57, 16, 28, 45, 12, 50, 24, 37)
GLM = "planner/data/model-configs/glm-5.2.json"


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """A small random GLM-MoE-DSA saved by transformers: 8 indexer heads, top 8 of prompts of 9-57 tokens,
    two full indexer layers and three shared ones, a dense first layer and a non-zero correction bias."""
    torch.manual_seed(0)
    model = transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(**TINY_GLM)).eval()
    return saved_reference(model, tmp_path_factory.mktemp("glm"), TINY_GLM["vocab_size"], PROMPT_LENGTHS)


def test_logits_and_greedy_tokens_match_transformers(glm):
    """And the selection matters: the same model attending densely gives logits 10x further off."""
    folder, model, prompts, expected = glm
    llm = engine(folder)
    assert [layer.self_attn.indexer is not None for layer in llm.core.model.layers] == [t == "full" for t in INDEXER_TYPES]
    assert llm.core.kv_cache.index_keys.shape == (2, 128, 8, 16)
    for prompt in prompts[:3]:
        with torch.no_grad():
            reference = model(torch.tensor([prompt])).logits[0]
        ours = llm.score(prompt)
        assert relative_error(ours, reference) < 1e-3
    assert greedy(llm, prompts) == expected
    dense = engine(folder)
    for layer in dense.core.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.topk = 1000
    prompt = prompts[4]
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0]
    assert relative_error(dense.score(prompt), reference) > 1e-2


def test_chunked_batched_and_preempted_runs_give_the_same_tokens(glm):
    """12 prompts at once, prefills cut into chunks of 16 tokens (a chunk's rows score the pages earlier chunks
    wrote); then in a pool too small for them all, so that sequences are preempted and recomputed."""
    folder, _, prompts, expected = glm
    chunked = engine(folder, max_num_batched_tokens=16)
    assert greedy(chunked, prompts) == expected
    starved = engine(folder, num_pages=20, max_num_batched_tokens=64)
    assert greedy(starved, prompts) == expected
    assert starved.num_preemptions > 0


def test_the_attention_reads_only_the_selected_tokens(glm):
    """One decode step of one sequence, run again over the same cache: corrupting the latent rows of a page no
    layer selected leaves the logits bit for bit; corrupting a selected page changes them."""
    from engine.executor.model_runner import forward_plan
    from engine.executor.step_plan import StepPlan

    folder, _, prompts, _ = glm
    llm = engine(folder)
    prompt, page_size = prompts[4], 8                                  # 57 tokens: pages 0-7
    pages = list(range(8))
    prefill = StepPlan(prompt, list(range(57)), list(range(57)), [], [], [(0, 57, 57, pages)], [])
    forward_plan(llm.core.model, llm.core.kv_cache, prefill, page_size, llm.device)
    selected = []
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda m, args, out: selected.append(out.decodes))
             for layer in llm.core.model.layers if layer.self_attn.indexer is not None]
    decode = StepPlan([7], [57], [57], [pages], [58], [], None)
    clean = forward_plan(llm.core.model, llm.core.kv_cache, decode, page_size, llm.device)
    for hook in hooks:
        hook.remove()
    read = {int(position) // page_size for positions in selected for position in positions.flatten()}
    unread = [page for page in pages if page not in read]
    assert unread and len(read) > 1
    latents = llm.core.kv_cache.latents
    saved = latents.clone()
    latents[:, unread] = torch.randn_like(latents[:, unread]) * 100
    assert torch.equal(forward_plan(llm.core.model, llm.core.kv_cache, decode, page_size, llm.device), clean)
    latents.copy_(saved)
    latents[:, min(read)] = torch.randn_like(latents[:, min(read)]) * 100
    assert relative_error(forward_plan(llm.core.model, llm.core.kv_cache, decode, page_size, llm.device), clean) > 1e-3


def prefill_selections(llm, prompts) -> list[torch.Tensor]:
    """The positions each full layer's indexer selected for every prompt row, scoring the prompts one by one."""
    selections = []
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda m, args, out: selections.append(out.prefills[0]))
             for layer in llm.core.model.layers if layer.self_attn.indexer is not None]
    for prompt in prompts:
        llm.score(prompt)
    for hook in hooks:
        hook.remove()
    return selections


def selection_overlap(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The mean share of a row's reference selection that `ours` selected too."""
    shares = []
    for a, b in zip(ours, reference):
        if b is not None:
            for ours_row, reference_row in zip(a, b):
                reference_set = set(reference_row.tolist()) - {-1}
                shares.append(len(set(ours_row.tolist()) & reference_set) / len(reference_set))
    return sum(shares) / len(shares)


def test_fp8_caches_select_nearly_the_same_tokens_and_fault_checks_cover_the_indexer_pages(glm):
    """FP8 latents (two static scales a layer) and FP8 indexer keys (a scale per token) select nearly the tokens
    an FP32 cache selects (measured 95% of them; BF16 99%). Logits are no measure here: with the top 8 of a few
    dozen tokens in a random model, one flipped choice moves them by 30% (BF16 too). Under `full` integrity, a
    flipped bit in an indexer key or in its scale changes its page's checksum and only that page's, and the
    fault campaign catches every kind on this model."""
    from campaign import assert_campaign_detects

    from engine.core.sequence import SamplingParams
    from engine.executor.integrity import page_checksums
    from engine.harness.fault_campaign import PAGE_FAULTS

    folder, _, prompts, _ = glm
    fp8 = engine(folder, kv_dtype="fp8", integrity="full", num_pages=160)
    reference = prefill_selections(engine(folder), prompts[:6])
    assert selection_overlap(prefill_selections(engine(folder, kv_dtype="bf16"), prompts[:6]), reference) > 0.97
    assert selection_overlap(prefill_selections(fp8, prompts[:6]), reference) > 0.9
    cache, checker = fp8.core.kv_cache, fp8.core.integrity
    assert len(cache.pools) == 3 and cache.index_key_scales.dtype == torch.float32
    all_pages = torch.arange(cache.num_pages)
    before = page_checksums(cache, all_pages, checker.weights)
    for pool, page in ((cache.index_keys, 5), (cache.index_key_scales, 9)):
        flat = pool.view(torch.uint8)[1, page].view(-1)
        flat[3] ^= 1 << 2
        assert (page_checksums(cache, all_pages, checker.weights) != before).nonzero().flatten().tolist() == [page]
        flat[3] ^= 1 << 2
    rng = random.Random(5)
    params = [SamplingParams(max_tokens=rng.randrange(4, 10), ignore_eos=True) for _ in prompts]
    assert_campaign_detects(fp8, (prompts, params), PAGE_FAULTS, trials=2, seed=6)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_engine_info_and_planner_plan_agree_to_the_byte_on_glm_cut_to_six_layers(tmp_path, kv):
    """GLM 5.2's first six layers: indexer layers 0, 1, 2 (full) and 3-5 shared, so the KV per token is
    6 latents of 576 elements and 3 indexer keys of 128 (FP8: and a 4-byte scale each)."""
    from test_deepseek import planner_json

    config = json.loads((REPO / GLM).read_text())
    config["num_hidden_layers"] = 6
    config["indexer_types"] = config["indexer_types"][:6]
    cut = tmp_path / "glm-6-layers.json"
    cut.write_text(json.dumps(config))
    info = json.loads(engine_cli("info", "--model", GLM, "--num-layers", "6", "--kv-dtype", kv, "--memory-gib",
                                 "1", "--json").stdout)
    plan = planner_json("plan", "--model", str(cut), "--hardware", "h200", "--gpus", "1", "--kv", kv)
    per_token = {"bf16": 2 * (6 * 576 + 3 * 128), "fp8": 6 * 576 + 3 * (128 + 4)}[kv]
    assert info["kv_bytes_per_token"] == plan["kv_bytes_per_token_per_gpu"] == per_token


def test_the_triton_indexer_and_sparse_decode_give_the_torch_tokens(glm, monkeypatch):
    """The engine's GPU path, run on CPU in the Triton interpreter: decodes score the paged indexer keys and
    attend over the selected latent rows with the two kernels."""
    from engine.kernels import indexer_scores, sparse_mla_decode
    from engine.kernels.backend import ENV_VARIABLE

    folder, _, prompts, expected = glm
    llm = engine(folder, page_size=16, num_pages=64)
    calls = {"scores": 0, "decode": 0}

    def counted(module, name, key):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[key] += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    counted(indexer_scores, "paged_indexer_scores", "scores")
    counted(sparse_mla_decode, "sparse_mla_decode", "decode")
    monkeypatch.setenv(ENV_VARIABLE, "triton")
    assert greedy(llm, prompts[:3]) == expected[:3]
    full_layers, layers = INDEXER_TYPES.count("full"), len(INDEXER_TYPES)
    assert calls["scores"] >= (MAX_TOKENS - 1) * full_layers and calls["decode"] >= (MAX_TOKENS - 1) * layers


def test_selected_pairs_count_what_each_prefill_row_attends():
    from engine.core.step_shape import selected_pairs

    for tokens, end, topk in ((5, 5, 8), (5, 12, 8), (30, 30, 8), (4, 40, 8), (1, 9, 8), (1, 8, 8), (16, 17, 16)):
        rows = range(end - tokens + 1, end + 1)                     # tokens each row sees before the cap
        assert selected_pairs(tokens, end, topk) == sum(min(seen, topk) for seen in rows), (tokens, end, topk)


def test_sparse_decode_cost_flattens_above_index_topk_and_the_crossover_is_printed():
    """GLM 5.2 on 8 H200s: one stream's decode step grows with the context at the indexer's rate above
    index_topk (its keys are 1/16 of the latents' bytes at BF16), at the latents' below; `planner compare`
    prints the context from which sparse attention beats dense MLA: past index_topk, since the indexer's
    weights and keys cost something, and well before 4x index_topk."""
    from test_deepseek import planner_json

    from planner.catalog.models import get_model
    from planner.deployment.capacity import Deployment, costing
    from planner.deployment.comparisons import sparse_attention_crossover

    deployment = Deployment(model="glm-5.2", hardware="h200", gpus=8, weights="fp8", kv_dtype="bf16")
    step = costing(deployment, get_model("glm-5.2")).single_stream_step
    below = (step(2048) - step(512)) / 1536
    above = (step(65536) - step(4096)) / 61440
    assert 0 < above < below / 8, (below, above)
    crossover = sparse_attention_crossover(deployment)
    assert 2048 < crossover < 4 * 2048
    made = planner_json("compare", "--model", "glm-5.2", "--hardware", "h200", "--gpus", "8", "--weights", "fp8",
                        "--kv", "bf16", "fp8")
    assert made["sparse_attention_crossover_context"]["fp8/bf16"] == crossover
    assert "sparse_attention_crossover_context" not in planner_json("compare", "--model", "llama-3.1-8b", "--hardware",
                                                                    "h200", "--gpus", "1")
