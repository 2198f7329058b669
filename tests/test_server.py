"""`engine serve`: the OpenAI-compatible server on SmolLM2, driven by the official `openai` client over real HTTP."""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from conftest import engine_cli
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2-135m"
PROMPT = "The three primary colours are"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server on a free port of 127.0.0.1 that traces its steps, its engine, and greedy references taken before
    it started."""
    from engine.core.sequence import SamplingParams
    from engine.harness.launch import serve_in_thread
    from engine.llm import LLM
    from engine.server.app import ServerConfig, build_app

    llm = LLM(model=MODEL, weights="fp32", device="cpu", max_num_seqs=64, kv_cache_gib=0.25)
    reference = llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    chat_prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}])
    chat_reference = llm.generate([chat_prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    trace = tmp_path_factory.mktemp("server") / "steps.jsonl"
    app = build_app(llm, ServerConfig(MODEL, step_trace=str(trace)))
    with llm, serve_in_thread(app) as url:
        yield {"url": url, "llm": llm, "engine": app.state.engine, "reference": reference,
               "chat_reference": chat_reference, "trace": trace}


def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served['url']}/v1", api_key="none", max_retries=0, timeout=120)


def metrics(served) -> dict[str, float]:
    with urllib.request.urlopen(f"{served['url']}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {sample.name + (json.dumps(sample.labels, sort_keys=True) if sample.labels else ""): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def wait_idle(served, timeout_s: float = 60.0) -> dict[str, float]:
    """The metrics once nothing runs or waits (a step or two after the last request ended)."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = metrics(served)
        if values["kvplan_requests_running"] == 0 and values["kvplan_requests_waiting"] == 0:
            return values
        assert time.monotonic() < deadline, f"the server never went idle: {values}"
        time.sleep(0.05)


def quarantined(served) -> int:
    return served["llm"].stats().quarantined_pages


def test_health_models_and_metrics(served):
    with urllib.request.urlopen(f"{served['url']}/health", timeout=10) as response:
        assert json.loads(response.read()) == {"status": "ok"}
    listed = client(served).models.list()
    assert [model.id for model in listed.data] == [MODEL]
    values = metrics(served)
    scheduler = served["llm"].scheduler_config
    assert values["kvplan_kv_capacity_tokens"] == served["llm"].capacity_tokens == scheduler.capacity_tokens
    info = next(key for key in values if key.startswith("kvplan_cache_config_info"))
    assert f'"num_pages": "{scheduler.num_pages}"' in info and f'"page_size": "{scheduler.page_size}"' in info


def test_completion_whole_and_streamed_match_the_engine(served):
    reference = served["reference"]
    whole = client(served).completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert whole.choices[0].text == reference.text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == MAX_TOKENS
    assert whole.usage.prompt_tokens == len(reference.prompt_token_ids)
    chunks = list(client(served).completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                                    stream=True, stream_options={"include_usage": True},
                                                    extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert len([c for c in chunks if c.choices and c.choices[0].finish_reason is None]) == MAX_TOKENS   # one a step


def test_token_id_prompt_and_chat(served):
    reference = served["reference"]
    by_ids = client(served).completions.create(model=MODEL, prompt=reference.prompt_token_ids, max_tokens=MAX_TOKENS,
                                               temperature=0, extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == reference.text
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client(served).chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                                  extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == served["chat_reference"].text
    streamed = list(client(served).chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                           temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == served["chat_reference"].text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_stop_string_ends_the_text_before_it(served):
    text = served["reference"].text
    stop = text.strip().split()[1]          # the second word of the greedy answer
    result = client(served).completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                               stop=[stop], extra_body={"ignore_eos": True})
    assert result.choices[0].finish_reason == "stop"
    assert result.choices[0].text == text[:text.index(stop)]
    values = wait_idle(served)
    assert values["kvplan_kv_pages_used"] == 0      # the engine let go of it too


def post(served, path: str, body: bytes) -> tuple[int, dict, dict]:
    request = urllib.request.Request(f"{served['url']}{path}", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read()), {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), {k.lower(): v for k, v in error.headers.items()}


@pytest.mark.parametrize("body, needle", [
    (b'{"model": "smollm2-135m", "prompt": "hi", ', "JSON"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": -3}).encode(), "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "hi", "bogus_field": 1}).encode(), "bogus_field"),
    (json.dumps({"model": MODEL, "prompt": [5] * 9000}).encode(), "context"),
    (json.dumps({"model": MODEL, "prompt": "hi", "temperature": -1}).encode(), "temperature"),
    (json.dumps({"model": MODEL, "prompt": ""}).encode(), "empty"),
])
def test_bad_requests_get_400_with_an_openai_error(served, body, needle):
    status, payload, _ = post(served, "/v1/completions", body)
    assert status == 400
    assert payload["error"]["type"] == "invalid_request_error"
    assert needle.lower() in payload["error"]["message"].lower()


def test_bad_requests_through_the_client_and_the_server_goes_on(served):
    with pytest.raises(openai.BadRequestError):
        client(served).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"bogus": True})
    with pytest.raises(openai.NotFoundError):
        client(served).completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    result = client(served).completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert result.choices[0].text == served["reference"].text


def test_full_queue_gets_429_with_retry_after(served):
    """The step thread held between two steps, one request queued: the next ones are refused at once."""
    engine = served["engine"]
    started, gate = threading.Event(), threading.Event()
    engine.between_steps(lambda llm: (started.set(), gate.wait(120)))
    assert started.wait(60)
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 4}).encode()
    engine.max_waiting, limit = 1, engine.max_waiting
    try:
        with ThreadPoolExecutor(3) as pool:
            queued = pool.submit(post, served, "/v1/completions", body)
            deadline = time.monotonic() + 30
            while metrics(served)["kvplan_requests_waiting"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            refused = [pool.submit(post, served, "/v1/completions", body) for _ in range(2)]
            refusals = [future.result(timeout=30) for future in refused]
            gate.set()
            status, payload, _ = queued.result(timeout=120)
    finally:
        engine.max_waiting = limit
        gate.set()
    assert [code for code, _, _ in refusals] == [429, 429]
    assert all(int(headers["retry-after"]) > 0 and error["error"]["type"] == "rate_limit_error"
               for _, error, headers in refusals)
    assert status == 200 and payload["usage"]["completion_tokens"] >= 1
    wait_idle(served)


def test_steps_are_traced_and_timed_by_regime(served):
    """The step trace holds each step's batch as the profile's shape fields, in order, without overlaps; /metrics
    counts the same steps by regime."""
    step_count = 'kvplan_step_duration_seconds_count{{"regime": "{}"}}'
    before, traced = metrics(served), len(served["trace"].read_text().splitlines())
    prompt = served["reference"].prompt_token_ids
    client(served).completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
    after = wait_idle(served)
    steps = [json.loads(line) for line in served["trace"].read_text().splitlines()[traced:]]
    assert len(steps) == MAX_TOKENS
    first, decodes = steps[0], steps[1:]
    assert (first["batch"]["num_prefills"], first["batch"]["prefill_tokens"], first["batch"]["num_decodes"]) == (
        1, len(prompt), 0)
    assert [step["batch"]["decode_context_tokens"] for step in decodes] == [
        len(prompt) + i for i in range(1, MAX_TOKENS)]
    assert all(step["batch"]["num_decodes"] == 1 and step["batch"]["num_prefills"] == 0 for step in decodes)
    assert all(later["start_s"] >= earlier["start_s"] + earlier["duration_s"] and earlier["more"]
               for earlier, later in zip(steps, steps[1:])) and not steps[-1]["more"]
    assert all(step["duration_s"] > 0 for step in steps)
    for regime, count in (("prefill", 1), ("decode", MAX_TOKENS - 1)):
        assert after[step_count.format(regime)] == before.get(step_count.format(regime), 0) + count


def test_disconnect_mid_stream_aborts_and_frees_the_pages(served):
    before = metrics(served)
    stream = client(served).completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, stream=True,
                                               extra_body={"ignore_eos": True})
    received = 0
    for _chunk in stream:
        received += 1
        if received == 2:
            break
    assert metrics(served)["kvplan_kv_pages_used"] > 0     # it holds pages while streaming
    stream.close()
    values = wait_idle(served, timeout_s=30)
    assert values["kvplan_kv_pages_used"] == 0
    aborted = 'kvplan_requests_finished_total{"finish_reason": "abort"}'
    assert values[aborted] == before.get(aborted, 0) + 1


def test_64_concurrent_streams_and_the_token_counters(served):
    """The load test: the `openai` async client as the load generator (guidellm needs the Hugging Face hub for
    its tokenizer and data, which this machine cannot reach)."""
    before = metrics(served)
    prompt_ids = served["reference"].prompt_token_ids

    async def load() -> list[tuple[int, int, int]]:
        async_client = openai.AsyncOpenAI(base_url=f"{served['url']}/v1", api_key="none", max_retries=0, timeout=300)

        async def one(index: int) -> tuple[int, int, int]:
            prompt = prompt_ids + [100 + index]
            chunks = await async_client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=6 + index % 3, stream=True, temperature=0.8, seed=index,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            pieces, usage = 0, None
            async for chunk in chunks:
                pieces += sum(1 for choice in chunk.choices if choice.finish_reason is None)
                usage = chunk.usage or usage
            return len(prompt), usage.completion_tokens, pieces

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), timeout=240)
        finally:
            await async_client.close()

    results = asyncio.run(load())
    assert [completion for _, completion, _ in results] == [6 + i % 3 for i in range(64)]
    assert all(pieces == completion for _, completion, pieces in results)
    values = wait_idle(served)
    assert values["kvplan_kv_pages_used"] == 0
    assert values["kvplan_kv_pages_free"] == served["llm"].scheduler_config.num_pages - quarantined(served)
    generated = values["kvplan_generation_tokens_total"] - before["kvplan_generation_tokens_total"]
    prompts = values["kvplan_prompt_tokens_total"] - before["kvplan_prompt_tokens_total"]
    assert generated == sum(completion for _, completion, _ in results)
    assert prompts == sum(prompt for prompt, _, _ in results)
    ttft_count = values["kvplan_time_to_first_token_seconds_count"] - before["kvplan_time_to_first_token_seconds_count"]
    assert ttft_count == 64


def test_integrity_violation_fails_only_its_request(served):
    from engine.harness.fault_campaign import inject

    engine = served["engine"]
    before = metrics(served)
    prompt_ids = served["reference"].prompt_token_ids
    faults = []

    async def run() -> list[object]:
        async_client = openai.AsyncOpenAI(base_url=f"{served['url']}/v1", api_key="none", max_retries=0, timeout=300)
        progress = [0, 0]

        async def one(index: int) -> str:
            chunks = await async_client.completions.create(model=MODEL, prompt=prompt_ids + [200 + index],
                                                           max_tokens=40, temperature=0, stream=True,
                                                           extra_body={"ignore_eos": True})
            text = []
            async for chunk in chunks:
                progress[index] += 1
                text += [choice.text for choice in chunk.choices]
            return "".join(text)

        async def strike() -> None:
            while min(progress) < 3:
                await asyncio.sleep(0.01)
            engine.between_steps(lambda llm: faults.append(inject(llm, "use_after_free", random.Random(0))))

        try:
            results = await asyncio.gather(one(0), one(1), strike(), return_exceptions=True)
        finally:
            await async_client.close()
        return results[:2]

    results = asyncio.run(run())
    assert faults and faults[0] is not None
    failed = [result for result in results if isinstance(result, Exception)]
    assert len(failed) == len(faults[0].victims) == 1, results
    assert isinstance(failed[0], openai.APIError) and "integrity" in str(failed[0])
    values = wait_idle(served)
    assert values["kvplan_integrity_aborts_total"] == before["kvplan_integrity_aborts_total"] + 1
    assert values["kvplan_kv_pages_used"] == 0
    result = client(served).completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert result.choices[0].text == served["reference"].text        # and it goes on serving


def test_serve_cli_refuses_bad_flags_in_one_line():
    result = engine_cli("serve", "--port", "70000")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "70000" in result.stderr


def test_cache_salt_separates_tenants(served):
    """The same prompt: a second request of one tenant finds its pages cached (OpenAI's `cached_tokens`), another
    tenant's does not, and the tokens are the same either way; /metrics counts the queries and hits."""
    prompt = " ".join(["Tenant isolation matters for prefix caches shared by many users."] * 4)
    before = metrics(served)
    usages, texts = {}, set()
    for name, salt in [("a", "tenant-a"), ("a again", "tenant-a"), ("b", "tenant-b")]:
        result = client(served).completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                                   extra_body={"cache_salt": salt, "ignore_eos": True})
        usages[name] = result.usage
        texts.add(result.choices[0].text)
    page_size = served["llm"].config.page_size
    full_pages = (usages["a"].prompt_tokens - 1) // page_size * page_size
    assert usages["a"].prompt_tokens_details.cached_tokens == 0
    assert usages["a again"].prompt_tokens_details.cached_tokens == full_pages > 0
    assert usages["b"].prompt_tokens_details.cached_tokens == 0
    assert len(texts) == 1
    after = wait_idle(served)
    assert after["kvplan_prefix_cache_hits_total"] - before["kvplan_prefix_cache_hits_total"] == full_pages
    assert after["kvplan_prefix_cache_queries_total"] - before["kvplan_prefix_cache_queries_total"] \
        == 3 * usages["a"].prompt_tokens
    assert after["kvplan_kv_pages_cached"] > 0 and after["kvplan_kv_pages_used"] == 0
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client(served).completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": ""})
