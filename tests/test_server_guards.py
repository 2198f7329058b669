"""`engine serve` for real traffic: the API key, the limits, request ids and token ids, over real HTTP with the
official `openai` client and with raw requests; the graceful shutdown of a real `engine serve` process."""
from __future__ import annotations

import http.client
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import openai
import pytest
from conftest import run_cli

MODEL = "smollm2-135m"
KEY, METRICS_KEY = "s3cret-key", "metrics-key"
MAX_MODEL_LEN, MAX_BODY = 256, 4096


@pytest.fixture(scope="module")
def guarded():
    """A server that requires a key (another on /metrics), with a 256-token context and a 4 KiB body limit."""
    from engine.harness.launch import serve_in_thread
    from engine.llm import LLM
    from engine.server.app import ServerConfig, build_app

    config = ServerConfig(MODEL, api_key=KEY, metrics_api_key=METRICS_KEY, max_body_bytes=MAX_BODY)
    with LLM(model=MODEL, weights="fp32", device="cpu", kv_cache_gib=0.05, max_model_len=MAX_MODEL_LEN) as llm, \
            serve_in_thread(build_app(llm, config)) as url:
        yield {"url": url, "llm": llm}


def client(served, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served['url']}/v1", api_key=key, max_retries=0, timeout=120)


def call(served, path: str, body: bytes | None = None, key: str | None = KEY,
         headers: dict[str, str] | None = None) -> tuple[int, dict, dict]:
    sent = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        sent["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"{served['url']}{path}", data=body, headers=sent)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, raw, got = response.status, response.read(), response.headers
    except urllib.error.HTTPError as error:
        status, raw, got = error.code, error.read(), error.headers
    payload = json.loads(raw) if got.get("content-type", "").startswith("application/json") else {"text": raw}
    return status, payload, {k.lower(): v for k, v in got.items()}


def completion(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "The sky is", "max_tokens": 4, **fields}).encode()


def test_the_key_through_the_official_client(guarded):
    with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
        client(guarded, "wrong").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client(guarded, "wrong").models.list()
    result = client(guarded).completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0)
    assert result.usage.completion_tokens == 3


def test_the_key_over_raw_http(guarded):
    for key, needle in ((None, "no API key"), ("wrong", "incorrect API key"), (KEY[:-1], "incorrect"),
                        (KEY + "x", "incorrect")):
        status, payload, headers = call(guarded, "/v1/completions", completion(), key=key)
        assert status == 401 and needle in payload["error"]["message"]
        assert payload["error"]["code"] == "invalid_api_key" and headers["www-authenticate"] == "Bearer"
        assert KEY not in json.dumps(payload)
    status, _, _ = call(guarded, "/v1/completions", completion(), headers={"Authorization": f"Basic {KEY}"}, key=None)
    assert status == 401
    assert call(guarded, "/health", key=None)[0] == 200         # open: load balancers probe it
    assert call(guarded, "/metrics", key=None)[0] == 401        # its own key
    assert call(guarded, "/metrics", key=KEY)[0] == 401
    status, payload, _ = call(guarded, "/metrics", key=METRICS_KEY)
    assert status == 200 and b'kvplan_requests_rejected_total{status="401"}' in payload["text"]
    assert b"process_resident_memory_bytes" in payload["text"]
    assert call(guarded, "/v1/completions", completion(), key=KEY)[0] == 200


def test_bodies_over_the_limit_get_413_declared_or_chunked(guarded):
    big = completion(prompt="word " * MAX_BODY)
    status, payload, _ = call(guarded, "/v1/completions", big)
    assert status == 413 and str(MAX_BODY) in payload["error"]["message"] and str(len(big)) in payload["error"]["message"]
    where = urlsplit(guarded["url"])
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    connection.request("POST", "/v1/completions", body=iter([big[:3000], big[3000:]]), encode_chunked=True,
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
                                "Transfer-Encoding": "chunked"})
    response = connection.getresponse()
    assert response.status == 413 and "more than" in json.loads(response.read())["error"]["message"]
    connection.close()
    status, _, _ = call(guarded, "/v1/completions", completion(prompt="word " * 100))   # under the limit: served
    assert status == 200


@pytest.mark.parametrize("fields, needles", [
    ({"max_tokens": MAX_MODEL_LEN}, ["max_tokens (256)", f"context of {MAX_MODEL_LEN} tokens"]),
    ({"prompt": list(range(1, MAX_MODEL_LEN + 2))}, ["257 tokens", f"{MAX_MODEL_LEN} tokens"]),
    ({"stop": ["a", "b", "c", "d", "e"]}, ["up to 4"]),
    ({"prompt": [1, 2, 49152]}, ["49152", "vocabulary"]),
    ({"prompt": [1, -4]}, ["-4"]),
    ({"n": 3}, ["n must be 1, got 3"]),
])
def test_limits_get_400_naming_the_numbers(guarded, fields, needles):
    status, payload, _ = call(guarded, "/v1/completions", completion(**fields))
    assert status == 400 and payload["error"]["type"] == "invalid_request_error"
    assert all(needle in payload["error"]["message"] for needle in needles), payload


def test_limits_through_the_client(guarded):
    with pytest.raises(openai.BadRequestError, match="256"):
        client(guarded).completions.create(model=MODEL, prompt="Hi", max_tokens=MAX_MODEL_LEN)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client(guarded).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2)
    models = client(guarded).models.list()
    assert models.data[0].max_model_len == MAX_MODEL_LEN


def test_request_ids_and_token_ids(guarded):
    """X-Request-Id names the response (and comes back); return_token_ids gives the ids the text decodes from, whole
    and streamed alike."""
    prompt = "Paged attention keeps the KV cache in"
    status, whole, headers = call(guarded, "/v1/completions", completion(
        prompt=prompt, max_tokens=6, temperature=0, ignore_eos=True, return_token_ids=True),
        headers={"X-Request-Id": "abc-1"})
    assert status == 200 and whole["id"] == "cmpl-abc-1" and headers["x-request-id"] == "abc-1"
    token_ids = whole["choices"][0]["token_ids"]
    assert len(token_ids) == 6 and guarded["llm"].tokenizer.decode(token_ids) == whole["choices"][0]["text"]
    chunks = list(client(guarded).completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                                     stream=True, extra_headers={"X-Request-Id": "abc-2"},
                                                     extra_body={"ignore_eos": True, "return_token_ids": True}))
    assert {chunk.id for chunk in chunks} == {"cmpl-abc-2"}
    assert [t for chunk in chunks for choice in chunk.choices for t in (getattr(choice, "token_ids", None) or [])] \
        == token_ids
    status, payload, _ = call(guarded, "/v1/completions", completion(), headers={"X-Request-Id": "bad id!"})
    assert status == 400 and "X-Request-Id" in payload["error"]["message"]


def test_server_config_and_its_notice():
    from engine.core.errors import ConfigError
    from engine.server.app import ServerConfig

    for bad in ({"api_key": ""}, {"api_key": "two words"}, {"metrics_api_key": "é"}, {"max_body_bytes": 10},
                {"drain_timeout_s": -1.0}, {"drain_timeout_s": float("nan")}):
        with pytest.raises(ConfigError):
            ServerConfig(MODEL, **bad)
    assert "loopback only" in ServerConfig(MODEL).startup_notice(100)
    assert "WARNING" in ServerConfig(MODEL, host="0.0.0.0").startup_notice(100)
    keyed = ServerConfig(MODEL, host="0.0.0.0", api_key="k").startup_notice(100)
    assert "requires the API key" in keyed and "k" not in keyed.split(";")[-1].replace("key", "")


@pytest.mark.parametrize("flags, needle", [
    (["--max-body-bytes", "10"], "max_body_bytes"),
    (["--api-key", "has space"], "API key"),
    (["--drain-timeout", "-3"], "drain_timeout"),
    (["--max-model-len", "100000"], "100000"),
])
def test_serve_refuses_bad_limits_in_one_line(flags, needle):
    result = run_cli("serve", *flags)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and needle in result.stderr


def test_sigterm_drains_what_runs_refuses_newcomers_and_exits_0():
    """A stream in flight completes with the tokens it gets alone; a new request gets 503 + Retry-After; exit 0."""
    from engine.harness.launch import ServerProcess

    server = ServerProcess(["--model", MODEL, "--drain-timeout", "120", "--memory-gib", "0.05"])
    try:
        body = {"prompt": "Graceful shutdown means", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        alone = call({"url": server.url}, "/v1/completions", completion(**body), key=None)[1]["choices"][0]["token_ids"]
        received: list[int] = []
        started = threading.Event()

        def stream() -> None:
            chunks = client({"url": server.url}, "none").completions.create(
                model=MODEL, stream=True, **{k: body[k] for k in ("prompt", "max_tokens", "temperature")},
                extra_body={"ignore_eos": True, "return_token_ids": True})
            for chunk in chunks:
                received.extend(t for choice in chunk.choices for t in (getattr(choice, "token_ids", None) or []))
                started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(120)
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while call({"url": server.url}, "/health", key=None)[0] != 503:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        status, payload, headers = call({"url": server.url}, "/v1/completions", completion(), key=None)
        assert status == 503 and int(headers["retry-after"]) > 0 and "shutting down" in payload["error"]["message"]
        reader.join(120)
        assert server.process.wait(60) == 0
        assert received == alone
        assert "drained: 1 of 1 requests completed, 0 aborted, 0 KV pages in use" in server.stderr
    finally:
        server.close()


def test_sigint_past_the_drain_timeout_aborts_with_a_final_error():
    """Requests still running when the drain timeout ends: a stream gets a last SSE error event, a whole answer
    a 503; their pages are freed and the process exits 0."""
    from engine.harness.launch import ServerProcess

    server = ServerProcess(["--model", MODEL, "--drain-timeout", "0.5", "--memory-gib", "0.05"])
    try:
        served = {"url": server.url}
        outcomes: dict[str, object] = {}
        started = threading.Event()

        def stream() -> None:
            chunks = client(served, "none").completions.create(model=MODEL, prompt="A long story:", max_tokens=1000,
                                                               stream=True, extra_body={"ignore_eos": True})
            try:
                for _chunk in chunks:
                    started.set()
                outcomes["stream"] = "completed"
            except openai.APIError as error:
                outcomes["stream"] = error

        def whole() -> None:
            outcomes["whole"] = call(served, "/v1/completions", completion(max_tokens=1000, ignore_eos=True), key=None)

        readers = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for reader in readers:
            reader.start()
        assert started.wait(120)
        time.sleep(0.5)
        server.process.send_signal(signal.SIGINT)
        for reader in readers:
            reader.join(120)
        assert server.process.wait(60) == 0
        assert isinstance(outcomes["stream"], openai.APIError) and "shutting down" in str(outcomes["stream"])
        status, payload, _ = outcomes["whole"]
        assert status == 503 and payload["error"]["type"] == "shutdown"
        assert "drained: 0 of 2 requests completed, 2 aborted, 0 KV pages in use" in server.stderr
    finally:
        server.close()
