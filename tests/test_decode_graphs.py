"""Decode steps over persistent buffers, padded to the captured batch sizes (`DecodeGraphs`): on CUDA each size is a
CUDA graph; here, on CPU, the same static-shape path runs eagerly, and its tokens must be the eager engine's."""
from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

from engine.core.config import EngineConfig
from engine.core.errors import ConfigError
from engine.core.sequence import SamplingParams
from engine.executor.model_runner import DecodeGraphs, graph_batch_sizes, graphs_refused
from engine.llm import LLM


@pytest.mark.parametrize(("max_num_seqs", "cap", "sizes"), [
    (256, None, [1, 2, 4, 8, *range(16, 257, 8)]),
    (12, None, [1, 2, 4, 8, 16]),           # the first size that holds the batch, padded
    (256, 4, [1, 2, 4]),
    (1, None, [1]),
    (40, 20, [1, 2, 4, 8, 16, 24]),
])
def test_graph_batch_sizes(max_num_seqs, cap, sizes):
    assert graph_batch_sizes(max_num_seqs, cap) == sizes


@pytest.mark.parametrize(("field", "value"), [("max_graph_batch", 0), ("max_graph_batch", 2.5),
                                              ("enforce_eager", "yes")])
def test_bad_graph_settings_are_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**{field: value})


def static_engine(num_pages: int, max_model_len: int) -> LLM:
    """An engine whose decode steps go through `DecodeGraphs` without capture; its last page is the padding page,
    taken out of the block manager's hands as the CUDA engine reserves it."""
    llm = LLM(model="smollm2-135m", num_pages=num_pages, max_model_len=max_model_len)
    worker = llm.core.worker
    worker.runner.graphs = DecodeGraphs(worker.model, worker.kv_cache, 16, max_model_len,
                                        graph_batch_sizes(llm.config.max_num_seqs, 8), num_pages - 1, capture=False)
    llm.core.block_manager.quarantine([num_pages - 1])
    return llm


def test_padded_static_decodes_give_the_eager_tokens_with_preemption_and_prefix_hits(engine, english_prompts):
    """Ragged batches (requests end at different lengths, so decode batches of 1..16 pad to 1, 2, 4, 8 or run
    eagerly above 8), a pool small enough to preempt, and a shared prefix that hits the cache."""
    prompts = english_prompts + [english_prompts[-1] + [11, 12, 13]]     # its prefix is cached by then
    params = [SamplingParams(max_tokens=4 + (i * 5) % 17, ignore_eos=True) for i in range(len(prompts))]
    expected = [r.token_ids for r in engine.generate(prompts, params)]
    with static_engine(num_pages=24, max_model_len=256) as llm:
        results = llm.generate(prompts, params)
        graphs = llm.core.worker.runner.graphs
        assert [r.token_ids for r in results] == expected
        assert llm.num_preemptions > 0 and graphs.replays > 10
        assert sum(r.num_cached_tokens for r in results) > 0
        llm.core.block_manager.check_invariants()


def test_padding_rows_write_only_the_padding_page(engine, english_prompts):
    with static_engine(num_pages=32, max_model_len=256) as llm:
        pool = llm.core.kv_cache.keys
        llm.generate(english_prompts[:3], SamplingParams(max_tokens=6, ignore_eos=True))
        assert pool[:, 31].abs().sum() > 0                    # 3 decodes padded to 4: the pad row wrote here
        before = pool.clone()
        one = llm.add_request(english_prompts[4], SamplingParams(max_tokens=3, ignore_eos=True))
        while llm.has_unfinished():
            llm.step()
        table_pages = {page for page in range(31) if not bool((pool[:, page] == before[:, page]).all())}
        assert one >= 0 and len(table_pages) >= 1 and 31 not in table_pages


@pytest.mark.parametrize(("model", "has_mtp", "experts_fused", "reason"), [
    ("llama-3.1-8b", False, True, None), ("smollm2-135m", False, True, None), ("qwen3-8b", False, True, None),
    ("deepseek-v3", False, True, None), ("kimi-k2.6", False, True, None),
    ("deepseek-v3", False, False, "routed experts"), ("glm-5.2", False, True, "sparse attention"),
    ("llama-3.1-8b", True, True, "MTP"),
])
def test_which_models_decode_through_graphs(model, has_mtp, experts_fused, reason):
    from engine.model.loader import read_model_config, resolve

    config = read_model_config(resolve(f"planner/data/model-configs/{model}.json"))
    refused = graphs_refused(config, has_mtp, experts_fused)
    assert refused is None if reason is None else reason in refused


def test_the_seed_effects_bench_says_it_needs_cuda():
    done = subprocess.run([sys.executable, "bench/gpu_seed_effects.py"], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 2 and "needs a CUDA device" in done.stderr and done.stdout == ""
