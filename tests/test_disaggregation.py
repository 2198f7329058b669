"""Disaggregated prefill and decode: the KV hand-off between two real engines, then between real servers."""
from __future__ import annotations

import dataclasses
import json
import time
from contextlib import ExitStack

import httpx2
import openai
import pytest
from fastapi import FastAPI, Request, Response

from engine.core.block_manager import BlockManager
from engine.core.config import SchedulerConfig
from engine.core.errors import RequestError
from engine.core.handoff import KVHandoff
from engine.core.memory import KVLayout, handoff_bytes, kv_bytes_per_token
from engine.core.scheduler import Scheduler
from engine.core.sequence import SamplingParams, Sequence
from engine.llm import LLM

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
LENGTHS = [3, 17, 40, 64, 93, 130]


def prefill_all(prefill: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[KVHandoff]:
    ids = [prefill.add_request(prompt, params, hands_off=True) for prompt in prompts]
    done = {}
    while prefill.has_unfinished():
        done.update((output.request_id, output) for output in prefill.step())
    assert prefill.core.block_manager.num_used_pages == 0        # every prefill's pages left with its hand-off
    return [done[request_id].handoff for request_id in ids]


def decode_all(decode: LLM, handoffs: list[KVHandoff]) -> list:
    ids = [decode.add_handoff(handoff) for handoff in handoffs]
    done = {}
    while decode.has_unfinished():
        done.update((output.request_id, output) for output in decode.step())
    return [done[request_id] for request_id in ids]


def corrupted(handoff: KVHandoff, offset: int) -> KVHandoff:
    payload = bytearray(handoff.payload)
    payload[offset] ^= 0x10
    return dataclasses.replace(handoff, payload=bytes(payload))


def test_handoff_frame_round_trip_and_refusals():
    layout = KVLayout(2, "bf16", num_kv_heads=1, head_dim=4)
    page_bytes = 4 * kv_bytes_per_token(layout)
    payload = bytes(range(256)) * (3 * page_bytes // 256) + bytes(3 * page_bytes % 256)
    handoff = KVHandoff.of_pages(list(range(10)), 7, GREEDY, layout, 4, "", payload, "tenant-a", "cmpl-1")
    assert handoff.num_pages == 3 and len(payload) == handoff_bytes(layout, 10, 4) == 3 * page_bytes
    again = KVHandoff.decode(handoff.encode())
    assert again == handoff and again.corrupt_pages() == []
    assert corrupted(again, page_bytes + 5).corrupt_pages() == [1]
    with pytest.raises(RequestError, match="not a KV hand-off frame"):
        KVHandoff.decode(b"HTTP/1.1 200")
    with pytest.raises(RequestError, match="carries 10 bytes of pages; its cache needs"):
        KVHandoff.of_pages(list(range(10)), 7, GREEDY, layout, 4, "", bytes(10))


def test_scheduler_admits_arrivals_by_free_pages():
    """A handed-off sequence waits until the pool holds its prompt and the token it decodes; prompts queued here
    (a preempted one) go first."""
    manager = BlockManager(num_pages=6, page_size=4)
    scheduler = Scheduler(SchedulerConfig(num_pages=6, page_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                                          max_model_len=64), manager)

    def arrival(prompt_tokens: int) -> Sequence:
        seq = Sequence(list(range(prompt_tokens)), SamplingParams(max_tokens=4, ignore_eos=True))
        seq.num_computed_tokens = prompt_tokens
        seq.append_token(1, 64)
        return seq

    first, second = arrival(11), arrival(9)          # 12 slots (3 pages), then 10 (3 pages): 6 pages in all
    scheduler.add_computed(first)
    scheduler.add_computed(second)
    out = scheduler.schedule()
    assert out.arrived == [first, second] and [item.start for item in out.chunks] == [11, 9]
    assert manager.num_free_pages == 0
    scheduler.update(out, None)
    third = arrival(3)
    scheduler.add_computed(third)
    out = scheduler.schedule()              # the first two grow into new pages: preemption, no admission
    assert not out.arrived and scheduler.arrivals[0] is third
    with pytest.raises(ValueError, match="one token to decode"):
        scheduler.add_computed(Sequence([1, 2], SamplingParams()))


def test_pair_decodes_the_single_engines_greedy_tokens(engine, english_prompts):
    """A prefill engine hands six prompts to a decode engine whose pool holds 12 pages: arrivals wait for pages and
    decodes preempt one another, and still every token is the single engine's."""
    prefill = LLM(model="smollm2-135m", weights="fp32", device="cpu", integrity="full")
    decode = LLM(model="smollm2-135m", weights="fp32", device="cpu", integrity="full", num_pages=12)
    prompts = [english_prompts[i] for i in (0, 4, 6, 9, 12, 15)]
    reference = [output.token_ids for output in engine.generate(prompts, GREEDY)]
    handoffs = prefill_all(prefill, prompts)
    assert [handoff.first_token for handoff in handoffs] == [tokens[0] for tokens in reference]
    assert [len(handoff.payload) for handoff in handoffs] == \
        [handoff_bytes(prefill.kv_layout, len(prompt), 16) for prompt in prompts]
    outputs = decode_all(decode, handoffs)
    assert [output.token_ids for output in outputs] == reference
    assert decode.num_preemptions > 0
    assert decode.core.block_manager.num_used_pages == 0


def test_corrupted_page_aborts_only_its_request(engine, english_prompts):
    """A bit flipped in transit fails the checksum taken before sending: that request ends with an integrity error
    before decoding, the others decode the single engine's tokens; no page is left held on either side."""
    prefill = LLM(model="smollm2-135m", weights="fp32", device="cpu", kv_dtype="fp8", integrity="full")
    decode = LLM(model="smollm2-135m", weights="fp32", device="cpu", kv_dtype="fp8", integrity="full",
                 num_pages=30)
    single = LLM(model="smollm2-135m", weights="fp32", device="cpu", kv_dtype="fp8")
    prompts = [english_prompts[i] for i in (2, 7, 10, 13, 15)]
    reference = [output.token_ids for output in single.generate(prompts, GREEDY)]
    handoffs = [KVHandoff.decode(handoff.encode()) for handoff in prefill_all(prefill, prompts)]
    victim = 2
    handoffs[victim] = corrupted(handoffs[victim], handoffs[victim].page_bytes + 3)       # its second page
    outputs = decode_all(decode, handoffs)
    assert [output.finish_reason for output in outputs] == ["length"] * 2 + ["integrity_error"] + ["length"] * 2
    assert outputs[victim].token_ids == reference[victim][:1]          # the prefill's token, nothing decoded
    assert [o.token_ids for i, o in enumerate(outputs) if i != victim] == \
        [r for i, r in enumerate(reference) if i != victim]
    assert decode.stats().handoff_corruptions == 1
    assert decode.core.block_manager.num_used_pages == 0 and prefill.core.block_manager.num_used_pages == 0
    with pytest.raises(RequestError, match="the hand-off was computed for the KV layout"):
        engine.add_handoff(handoffs[0])          # FP8 pages into an FP32 cache


@pytest.fixture(scope="module")
def served_pair():
    """`engine serve --role prefill` and `--role decode` (each on a thread of this process), `engine proxy` in front,
    and a single engine's greedy answers to compare with."""
    from engine.harness.launch import serve_in_thread
    from engine.server.app import ServerConfig, build_app
    from engine.server.proxy import ProxyConfig, build_proxy

    engines = {role: LLM(model="smollm2-135m", weights="fp32", device="cpu", kv_cache_gib=0.1)
               for role in ("prefill", "decode")}
    apps = {role: build_app(llm, ServerConfig("smollm2-135m", role=role)) for role, llm in engines.items()}
    with ExitStack() as stack:
        for llm in engines.values():
            stack.enter_context(llm)
        urls = {role: stack.enter_context(serve_in_thread(app)) for role, app in apps.items()}
        proxy = build_proxy(ProxyConfig((urls["prefill"],), (urls["decode"],)))
        urls["proxy"] = stack.enter_context(serve_in_thread(proxy))
        yield {"urls": urls, "engines": {role: app.state.engine for role, app in apps.items()},
               "client": openai.OpenAI(base_url=f"{urls['proxy']}/v1", api_key="none", max_retries=0, timeout=120)}


def settled(served_pair, timeout_s: float = 30.0) -> dict[str, int]:
    """Pages held on each side once both replicas have nothing in flight."""
    deadline = time.monotonic() + timeout_s
    engines = served_pair["engines"]
    while any(engine.num_in_flight or engine.llm.has_unfinished() for engine in engines.values()):
        assert time.monotonic() < deadline, "the replicas did not settle"
        time.sleep(0.05)
    return {role: engine.pages_held for role, engine in engines.items()}


def decode_ttft(served_pair) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx2.get(f"{served_pair['urls']['decode']}/metrics", timeout=30).text
    samples = {sample.name: sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name.startswith("kvplan_time_to_first_token_seconds")}
    return {"count": samples["kvplan_time_to_first_token_seconds_count"],
            "sum": samples["kvplan_time_to_first_token_seconds_sum"]}


def test_proxy_serves_the_single_engines_tokens(engine, english_prompts, served_pair):
    prompts = [english_prompts[i] for i in (1, 5, 11)]
    reference = engine.generate(prompts, GREEDY)
    client = served_pair["client"]
    for prompt, expected in zip(prompts, reference):
        whole = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=GREEDY.max_tokens,
                                          temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
        assert whole.choices[0].model_extra["token_ids"] == expected.token_ids
        assert whole.usage.completion_tokens == GREEDY.max_tokens
    streamed = client.completions.create(model="smollm2-135m", prompt=prompts[0], max_tokens=GREEDY.max_tokens,
                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == reference[0].text
    ttft = decode_ttft(served_pair)         # the decode replica counts each TTFT from before the prefill it asked for
    assert ttft["count"] == len(prompts) + 1 and ttft["sum"] / ttft["count"] > 0.02
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=6, temperature=0)
    chat_prompt = engine.tokenizer.apply_chat_template(messages)
    assert chat.choices[0].message.content == engine.generate([chat_prompt], SamplingParams(max_tokens=6))[0].text
    assert settled(served_pair) == {"prefill": 0, "decode": 0}


def test_corruption_on_the_link_aborts_only_that_request(english_prompts, served_pair):
    """A relay between the replicas flips one bit of a hand-off's second page: the decode replica answers that
    request with an integrity error; the next request through the same replicas is served."""
    from engine.harness.launch import serve_in_thread

    relay = FastAPI()
    prefill_url = served_pair["urls"]["prefill"]

    @relay.post("/v1/prefill")
    async def corrupt(request: Request) -> Response:
        async with httpx2.AsyncClient() as link:
            answer = await link.post(f"{prefill_url}/v1/prefill", content=await request.body(),
                                     headers={"content-type": "application/json"}, timeout=120)
        handoff = KVHandoff.decode(answer.content)
        return Response(corrupted(handoff, handoff.page_bytes + 11).encode(), media_type=answer.headers["content-type"])

    with serve_in_thread(relay) as relay_url:
        answer = httpx2.post(f"{served_pair['urls']['decode']}/v1/completions", timeout=120,
                             json={"model": "smollm2-135m", "prompt": english_prompts[8], "max_tokens": 8,
                                   "temperature": 0, "kv_transfer_params": {"prefill_url": relay_url}})
    assert answer.status_code == 500 and answer.json()["error"]["type"] == "integrity_error"
    good = served_pair["client"].completions.create(model="smollm2-135m", prompt=english_prompts[8], max_tokens=8,
                                                    temperature=0)
    assert good.choices[0].finish_reason in ("length", "stop") and good.choices[0].text
    assert served_pair["engines"]["decode"].llm.stats().handoff_corruptions == 1
    assert settled(served_pair) == {"prefill": 0, "decode": 0}


def test_disconnects_leave_no_page_held(english_prompts, served_pair):
    """Clients that go away mid-stream, and one that goes away while its prompt is still being computed: neither
    replica keeps a page once they settle."""
    proxy = served_pair["urls"]["proxy"]
    body = {"model": "smollm2-135m", "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    for index in (3, 9, 14):
        with httpx2.stream("POST", f"{proxy}/v1/completions", json={**body, "prompt": english_prompts[index]},
                           timeout=120) as response:
            assert response.status_code == 200
            next(response.iter_lines())          # the first token arrived: then the client leaves
    with pytest.raises(httpx2.TimeoutException):
        httpx2.post(f"{proxy}/v1/completions", json={**body, "stream": False, "prompt": english_prompts[15] * 4},
                    timeout=0.05)
    assert settled(served_pair) == {"prefill": 0, "decode": 0}
    refused = httpx2.post(f"{served_pair['urls']['prefill']}/v1/completions", timeout=30,
                          json={"model": "smollm2-135m", "prompt": [1, 2], "kv_transfer_params": {"prefill_url": proxy}})
    assert refused.status_code == 400 and "role is prefill, not decode" in refused.json()["error"]["message"]


# The planner's side: the same scheduler in both pools, the link between them.

def _pools(page_size: int = 16, decode_pages: int = 400):
    from engine.core.config import SchedulerConfig

    def config(pages: int) -> SchedulerConfig:
        return SchedulerConfig(num_pages=pages, page_size=page_size, max_num_seqs=64, max_num_batched_tokens=2048,
                               max_model_len=8192)
    return config(400), config(decode_pages)


def _step(output) -> float:
    return 0.01 + 1e-4 * output.num_batched_tokens


def _workload(requests: int = 120, prompt: str = "1000", output: str = "50"):
    from planner.simulation.workload import LengthDistribution, Workload

    return Workload(arrival="poisson", num_requests=requests, rate=4.0, prompt=LengthDistribution.parse(prompt),
                    output=LengthDistribution.parse(output), seed=3)


def test_simulated_handoffs_move_the_engines_bytes_and_delay_the_first_token():
    from planner.simulation.disaggregated import DisaggregatedSimulation, HandoffLink

    layout = KVLayout(30, "bf16", num_kv_heads=3, head_dim=64)        # SmolLM2's cache

    def run(bytes_per_s: float):
        prefill, decode = _pools()
        simulation = DisaggregatedSimulation(prefill, _step, 1, decode, _step, 2,
                                             HandoffLink(bytes_per_s, bytes_of=lambda n: handoff_bytes(layout, n, 16)))
        return simulation, simulation.run(_workload())

    fast, fast_result = run(1e12)
    slow, slow_result = run(1e8)            # 1000 tokens x 46 KB = 46 MB: 0.46 s each, one at a time
    requests = _workload().requests()
    assert fast.stats.transfers == slow.stats.transfers == len(requests)
    assert fast.stats.bytes == sum(handoff_bytes(layout, r.prompt_tokens, 16) for r in requests)
    assert all(t.output_tokens == r.output_tokens for t, r in zip(sorted(slow_result.timings, key=lambda t: t.request_id),
                                                                  sorted(requests, key=lambda r: r.request_id)))
    one_transfer = handoff_bytes(layout, 1000, 16) / 1e8
    gained = slow_result.report()["ttft_p50_s"] - fast_result.report()["ttft_p50_s"]
    assert gained >= one_transfer and max(slow.stats.seconds) > 1.5 * one_transfer       # queued behind others
    assert slow_result.report()["tpot_p50_s"] == pytest.approx(fast_result.report()["tpot_p50_s"], rel=0.2)


def test_simulated_decode_pool_admits_by_free_pages():
    from planner.simulation.disaggregated import DisaggregatedSimulation, HandoffLink

    prefill, decode = _pools(decode_pages=200)      # 3,200 slots: three 1,050-token requests at a time
    simulation = DisaggregatedSimulation(prefill, _step, 1, decode, _step, 1, HandoffLink(1e12, bytes_of=lambda n: n))
    result = simulation.run(_workload(requests=40, output="200"))
    assert len(result.timings) == 40 and all(t.output_tokens == 200 for t in result.timings)
    assert result.peak_running <= 3 and result.kv_utilization_peak <= 1.0
    with pytest.raises(Exception, match="pages differ"):
        DisaggregatedSimulation(_pools(page_size=8)[0], _step, 1, decode, _step, 1, HandoffLink(1e9, bytes_of=lambda n: n))


def test_planned_pools_and_their_deploy_commands():
    from planner.deployment.capacity import Deployment
    from planner.deployment.commands import pool_commands
    from planner.deployment.disaggregated import disaggregated_setup, parse_pools, plan_summary, split_pools
    from planner.errors import PlannerError

    base = Deployment(model="deepseek-v3", hardware="h200", gpus=8, weights="fp8", kv_dtype="fp8")
    pools = split_pools(base, *parse_pools("1P3D"))
    summary = plan_summary(pools)
    assert (summary["pools"], summary["gpus"], summary["link"], summary["link_gb_s"]) == ("1P3D", 32, "network", 400)
    assert summary["handoff_bytes_per_token"] == 61 * 576            # one FP8 copy of the MLA latent and rope key
    assert summary["handoff_s_at_context"] == pytest.approx(8192 * 61 * 576 / 400e9, rel=1e-3)
    commands = pool_commands(pools)
    sglang, vllm = commands["sglang"], commands["vllm"]
    assert sum("--disaggregation-mode decode" in line for line in sglang) == 3
    assert "--pd-disaggregation" in sglang[-1] and sglang[-1].count("--decode") == 3
    assert sum('"kv_role":"kv_producer"' in line for line in vllm) == 1
    assert all("--quantization fp8" in line and "--kv-cache-dtype fp8" in line for line in vllm[:4])
    with pytest.raises(PlannerError, match="bad pools '2X'"):
        parse_pools("2X")
    with pytest.raises(PlannerError, match="differ in kv_dtype"):
        type(pools)(pools.prefill, Deployment(**{**pools.decode.__dict__, "kv_dtype": "bf16"}))
    polled = split_pools(dataclasses.replace(base, scheduler_recv_interval=7), *parse_pools("1P3D"))
    simulation = disaggregated_setup(polled).simulation()
    assert {replica.receive_interval for replica in simulation.prefill + simulation.replicas} == {7}


def test_planner_cli_simulates_disaggregated_pools():
    import subprocess
    import sys

    command = [sys.executable, "-m", "planner.cli", "simulate", "--model", "llama-3.1-8b", "--hardware", "h100-sxm",
               "--gpus", "1", "--disaggregate", "1P2D", "--requests", "60", "--rate", "5", "--prompt-tokens", "3000",
               "--output-tokens", "100", "--json"]      # FP8 KV: 32 layers x K,V x 8 heads x 128 bytes a token
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["pools"] == "1P2D" and report["gpus"] == 3 and report["completed"] == 60
    assert report["handoff_bytes_per_request"] == 3008 * 32 * 2 * 8 * 128 and report["ttft_p50_s"] > report["handoff_p50_s"] > 0
    bad = subprocess.run([("0P2D" if part == "1P2D" else part) for part in command], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "0P2D" in bad.stderr


def test_search_weighs_disaggregated_pools_against_aggregated_ones():
    from planner.search.deployments import SearchSpace, Slo, preset_workload, run_search

    space = SearchSpace("llama-3.1-8b", ("h100-sxm",), 2, ("fp8",), ("fp8",), (256,), (2048,),
                        pool_ratios=((1, 1),))
    result = run_search(space, preset_workload("rag", 60, seed=1), Slo.parse("ttft_p99_s=3,tpot_p99_s=0.05"),
                        executor="serial")
    summary = result.summary(top=10)
    kinds = {row["pools"] for row in summary["ranked"]}
    assert kinds == {None, "1P1D"}                       # 1 and 2 GPUs aggregated, one 1P1D pair of 1-GPU instances
    verdict = summary["disaggregation"]
    assert verdict["winner"] in ("aggregated", "disaggregated")
    assert verdict["aggregated"]["usd_per_million_tokens"] > 0 and verdict["disaggregated"]["max_rate_rps"] > 0
    pools_deploy = next(item for item in summary["deploy"] if item["configuration"].startswith("1P1D"))
    assert pools_deploy["sglang"].count("--disaggregation-mode") == 2 and "kv_consumer" in pools_deploy["vllm"]
