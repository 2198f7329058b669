"""Speculative decoding with prompt-lookup drafts: the same greedy tokens, the target distribution when sampling,
and page accounting through rollbacks (chunked prefill, preemption, integrity checks, the fault campaign)."""
from __future__ import annotations

import json
import random

import pytest
import torch
from campaign import assert_campaign_detects

from engine.core.block_manager import BlockManager
from engine.core.errors import ConfigError
from engine.core.sequence import SamplingParams
from engine.core.speculative import NgramIndex, NgramProposer, SpeculativeConfig
from engine.executor.sampler import filter_logits, verify_drafts
from engine.harness.fault_campaign import OWNERSHIP_FAULTS
from engine.llm import LLM

TEXT = "The quick brown fox jumps over the lazy dog near the river bank. "


def test_config_parses_and_refuses_bad_values():
    assert SpeculativeConfig.parse("ngram:4") == SpeculativeConfig("ngram", 4)
    for bad in ("ngram", "ngram:0", "ngram:x", "medusa:2", "ngram:99"):
        with pytest.raises(ConfigError, match="speculative"):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ConfigError, match="speculative"):
        LLM(model="smollm2-135m", device="cpu", speculative="ngram:-1")


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    index = NgramIndex(range(1, 4))
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert index.propose(tokens, 3) == [7, 8, 1]          # the latest earlier "1 2 3" is followed by 7 8 1
    assert index.propose(tokens + [7], 2) == [8, 1]       # "3 7" (and "2 3 7") seen once, followed by 8 1
    assert NgramIndex(range(1, 4)).propose([5, 6, 7], 3) == []     # nothing repeats
    proposer = NgramProposer(SpeculativeConfig("ngram", 4))
    assert proposer.propose(0, tokens, room=2) == [7, 8]  # never more than max_tokens leaves
    assert proposer.propose(0, tokens, room=0) == []


def test_truncate_gives_back_the_pages_of_rejected_slots():
    manager = BlockManager(num_pages=8, page_size=4)
    manager.allocate(1, 6)
    manager.append(1, 5)                    # 11 slots: 3 pages
    assert len(manager.block_table(1)) == 3 and manager.num_free_pages == 5
    manager.truncate(1, 7)                  # 7 slots: 2 pages
    assert len(manager.block_table(1)) == 2 and manager.num_free_pages == 6 and manager.num_slots(1) == 7
    manager.check_invariants()
    with pytest.raises(ValueError, match="cannot keep 9"):
        manager.truncate(1, 9)
    manager.free(1)
    assert manager.num_free_pages == 8


def _total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def test_rejection_sampling_keeps_the_target_distribution():
    """Six tokens, two fixed drafts, random target logits: the first token drawn follows the target's p0 and,
    when the first draft stood, the second follows p1 (40,000 draws: total variation under 0.015)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5)
    probs = [filter_logits(row, params).softmax(-1) for row in logits]
    drafts = (int(probs[0].argsort()[-2]), 3)        # a likely but not the likeliest first draft
    generator = torch.Generator().manual_seed(1)
    first, second = torch.zeros(6), torch.zeros(6)
    for _ in range(40_000):
        accepted, token = verify_drafts(logits, drafts, params, generator)
        emitted = [*drafts[:accepted], token]
        first[emitted[0]] += 1
        if emitted[0] == drafts[0]:
            second[emitted[1]] += 1
    assert _total_variation(first, probs[0]) < 0.015
    assert _total_variation(second, probs[1]) < 0.015
    assert first[int(probs[0].argmin())] == 0 or probs[0].min() > 0      # top-k's cut token is never drawn


def test_greedy_drafts_stop_at_the_first_mismatch():
    logits = torch.full((4, 5), -5.0)
    for row, best in enumerate((2, 4, 1, 0)):
        logits[row, best] = 5.0
    greedy = SamplingParams()
    assert verify_drafts(logits, (2, 4, 1), greedy, None) == (3, 0)
    assert verify_drafts(logits, (2, 3, 1), greedy, None) == (1, 4)
    assert verify_drafts(logits, (0, 4, 1), greedy, None) == (0, 2)


def _prompts(tokenizer) -> list[list[int]]:
    """Prompts where lookup hits (text to repeat, a count to continue) and one where it rarely does."""
    texts = [f"Repeat exactly: {TEXT * 4}\nRepeat:", "one two three four five six seven eight one two three four",
             "Write a short poem about the sea.", f"Summarize: {TEXT * 2}"]
    return [tokenizer.encode(text) for text in texts]


def _run(llm: LLM, prompts, params) -> list[list[int]]:
    """Runs to completion, checking the allocator's accounting after every step."""
    ids = [llm.add_request(prompt, request_params) for prompt, request_params in zip(prompts, params)]
    outputs = {}
    while llm.has_unfinished():
        outputs.update((r.request_id, r.token_ids) for r in llm.step())
        llm.core.block_manager.check_invariants()
    assert llm.core.block_manager.num_used_pages == 0
    return [outputs[request_id] for request_id in ids]


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 24},                  # chunked prefill, drafts cut to the budget
    {"num_pages": 24, "page_size": 8},               # preemption: the pool holds about two of them at a time
    {"integrity": "full", "page_size": 8},           # checksums sealed after the rollback, verified on reads
])
def test_greedy_tokens_are_those_of_plain_decoding(engine, options):
    prompts = _prompts(engine.tokenizer)
    params = [SamplingParams(max_tokens=40, ignore_eos=True) for _ in prompts]
    reference = [result.token_ids for result in engine.generate(prompts, params)]
    llm = LLM(model="smollm2-135m", device="cpu", speculative="ngram:4", **options)
    assert _run(llm, prompts, params) == reference
    assert llm.stats().draft_tokens > 0 and llm.acceptance_rate > 0.2
    if "num_pages" in options:
        assert llm.num_preemptions > 0


def test_stop_tokens_inside_accepted_drafts_end_the_request(engine):
    """A request whose max_tokens falls inside a run of accepted drafts gets exactly max_tokens tokens."""
    prompt = _prompts(engine.tokenizer)[0]
    llm = LLM(model="smollm2-135m", device="cpu", speculative="ngram:8")
    for max_tokens in (1, 2, 5, 11):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        expected = engine.generate([prompt], params)[0].token_ids
        assert _run(llm, [prompt], [params]) == [expected]


def test_the_fault_campaign_with_drafts(english_prompts):
    """Every ownership fault strikes an engine whose steps verify drafts and roll back: all detected, nobody else
    harmed, no page leaked."""
    rng = random.Random(3)
    system = list(range(300, 320))              # a shared opening (pages of 8 shared), then a repeated prompt
    prompts = [system + prompt + prompt for prompt in english_prompts[:8]]
    params = [SamplingParams(max_tokens=rng.randrange(6, 14), ignore_eos=True) for _ in prompts]
    llm = LLM(model="smollm2-135m", device="cpu", page_size=8, num_pages=400, speculative="ngram:3",
              max_num_batched_tokens=96)
    assert_campaign_detects(llm, (prompts, params), OWNERSHIP_FAULTS, 1, seed=9)
    assert llm.stats().draft_tokens > 0


def test_the_server_counts_drafts_like_vllm(tmp_path):
    """`engine serve --speculative`: /metrics has the drafts verified and those that stood, and the engine's
    stats say the same."""
    import urllib.request

    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from engine.harness.launch import serve_in_thread
    from engine.server.app import ServerConfig, build_app

    trace = tmp_path / "steps.jsonl"
    with LLM(model="smollm2-135m", device="cpu", speculative="ngram:4", kv_cache_gib=0.05) as llm, \
            serve_in_thread(build_app(llm, ServerConfig("smollm2-135m", step_trace=str(trace)))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        client.completions.create(model="smollm2-135m", prompt=f"Repeat exactly: {TEXT * 3}\nRepeat:", max_tokens=24,
                                  temperature=0, extra_body={"ignore_eos": True})
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
            values = {sample.name: sample.value for family in text_string_to_metric_families(response.read().decode())
                      for sample in family.samples}
    assert values["kvplan_spec_decode_num_draft_tokens_total"] == llm.stats().draft_tokens > 0
    assert values["kvplan_spec_decode_num_accepted_tokens_total"] == llm.stats().accepted_tokens > 0
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert sum(step.get("drafts", 0) for step in steps) == llm.stats().draft_tokens      # the step trace has them too
    assert sum(step.get("accepted", 0) for step in steps) == llm.stats().accepted_tokens


@pytest.fixture(scope="module")
def mtp_config(tmp_path_factory):
    """A tiny DeepSeek-V3 config with its MTP layer (random weights: the engine makes them)."""
    from test_deepseek import TINY_DEEPSEEK

    path = tmp_path_factory.mktemp("mtp") / "config.json"
    path.write_text(json.dumps({**TINY_DEEPSEEK, "model_type": "deepseek_v3", "num_nextn_predict_layers": 1,
                                "architectures": ["DeepseekV3ForCausalLM"], "eos_token_id": 1}))
    return str(path)


def _token_prompts(count: int) -> list[list[int]]:
    return [[(7 * index + offset) % 150 + 2 for offset in range(length)]
            for index, length in enumerate((5, 17, 40, 3, 29, 11)[:count])]


@pytest.mark.parametrize("drafts, options", [(1, {}), (1, {"max_num_batched_tokens": 16}), (1, {"num_pages": 14}),
                                             (3, {}), (3, {"num_pages": 14, "max_num_batched_tokens": 16})])
def test_mtp_drafts_keep_greedy_tokens(mtp_config, drafts, options):
    """MTP drafts (the module chained for more than one) on a DeepSeek-V3 config: the same greedy tokens as without,
    chunked prefill and preemption included; its cache is a layer of the pool after the main ones; no page held."""
    prompts, params = _token_prompts(6), [SamplingParams(max_tokens=20, ignore_eos=True)] * 6
    plain = LLM(model=mtp_config, device="cpu", page_size=8, **options)
    drafted = LLM(model=mtp_config, device="cpu", page_size=8, speculative=f"mtp:{drafts}", **options)
    assert drafted.kv_layout.num_layers == plain.kv_layout.num_layers + 1
    assert _run(drafted, prompts, params) == [result.token_ids for result in plain.generate(prompts, params)]
    stats = drafted.draft_stats.summary()
    assert stats["draft_tokens"] > 50 and sum(stats["draft_length_shares"][1:]) > 0.8   # drafts nearly every decode
    if drafts > 1 and "num_pages" not in options:
        assert stats["draft_length_shares"][drafts] > 0.5
    if "num_pages" in options:
        assert drafted.num_preemptions > 0


def test_mtp_cache_written_step_by_step_is_the_one_of_a_whole_prompt(mtp_config):
    """The draft an engine made after each decode step equals the draft of a fresh engine that reads everything up
    to that token as one prompt (in 16-token chunks): the MTP module's cache rows were written where they belong,
    and each step attended to the earlier ones."""
    prompt = _token_prompts(3)[2]
    stepped = LLM(model=mtp_config, device="cpu", page_size=8, speculative="mtp:1")
    request = stepped.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    drafts, tokens = {}, None
    while stepped.has_unfinished():
        for result in stepped.step():
            tokens = result.token_ids
        entry = stepped.core.executor.mtp_drafts._drafts.get(request)
        if entry is not None:
            drafts[entry[0]] = entry[1]
    assert tokens is not None and len(drafts) >= 10
    for computed in sorted(drafts)[1::3]:
        whole = LLM(model=mtp_config, device="cpu", page_size=8, speculative="mtp:1", max_num_batched_tokens=16)
        known = (prompt + tokens)[:computed]
        seq_id = whole.add_request(known, SamplingParams(max_tokens=2, ignore_eos=True))
        while whole.has_unfinished():
            whole.step()
            entry = whole.core.executor.mtp_drafts._drafts.get(seq_id)
            if entry is not None and entry[0] == computed:
                break
        assert entry == (computed, drafts[computed])


def test_mtp_is_refused_where_it_cannot_run(mtp_config):
    with pytest.raises(ConfigError, match="no multi-token-prediction layer"):
        LLM(model="smollm2-135m", device="cpu", speculative="mtp:1")
    with pytest.raises(ConfigError, match="one device"):
        LLM(model=mtp_config, device="cpu", speculative="mtp:2", tensor_parallel=2)


def test_the_fault_campaign_with_mtp_drafts(mtp_config):
    """Ownership faults on an engine whose MTP module writes its own layer of the pages after every step: all
    detected, nobody else harmed, no page leaked."""
    rng = random.Random(4)
    system = list(range(100, 120))
    prompts = [system + prompt for prompt in _token_prompts(6)]
    params = [SamplingParams(max_tokens=rng.randrange(6, 14), ignore_eos=True) for _ in prompts]
    llm = LLM(model=mtp_config, device="cpu", page_size=8, num_pages=300, speculative="mtp:1",
              max_num_batched_tokens=64)
    assert_campaign_detects(llm, (prompts, params), OWNERSHIP_FAULTS, 1, seed=12)
    assert llm.stats().draft_tokens > 0


def test_chained_mtp_drafts_are_those_of_a_whole_prompt(mtp_config):
    """mtp:3: the drafts a step verified (the first from the previous step's pass, two chained in the step) equal
    those a fresh engine verifies in its first decode after reading everything up to there as one prompt."""
    prompt = _token_prompts(2)[1]
    stepped = LLM(model=mtp_config, device="cpu", page_size=8, speculative="mtp:3")
    stepped.add_request(prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    verified, tokens = {}, None
    while stepped.has_unfinished():
        for result in stepped.step():
            tokens = result.token_ids
        for item in stepped.last_step.chunks:
            if item.drafts:
                verified[item.start] = item.drafts
    assert tokens is not None and len(verified) >= 3
    full = [start for start in sorted(verified) if len(verified[start]) == 3]
    assert len(full) >= 3
    for start in full[::2]:
        whole = LLM(model=mtp_config, device="cpu", page_size=8, speculative="mtp:3", max_num_batched_tokens=16)
        whole.add_request((prompt + tokens)[:start], SamplingParams(max_tokens=8, ignore_eos=True))
        first = None
        while first is None and whole.has_unfinished():
            whole.step()
            first = next((item.drafts for item in whole.last_step.chunks if item.drafts), None)
        assert first == verified[start][:len(first)] and len(first) == len(verified[start])
