"""The `engine` command line: JSON contracts and one-line errors with exit code 2."""
from __future__ import annotations

import json

import pytest
from conftest import engine_cli, run_cli


def test_generate_json_contract():
    done = run_cli("generate", "--model", "smollm2-135m", "--prompt", "What is the capital of France?",
                   "--max-tokens", "24", "--json")
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert set(payload) == {"text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens"}
    assert "Paris" in payload["text"]
    assert payload["completion_tokens"] == len(payload["token_ids"]) <= 24
    assert payload["finish_reason"] in ("stop", "length")
    assert payload["prompt_tokens"] > 10     # the chat template wraps the prompt


def test_info_json_is_exact():
    done = engine_cli("info", "--model", "smollm2-135m", "--memory-gib", "2", "--page-size", "32",
                      "--kv-dtype", "bf16", "--json")
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    per_token = 2 * 30 * 3 * 64 * 2
    pages = (2 << 30) // (32 * per_token)
    assert {key: payload[key] for key in ("weight_bytes", "kv_bytes_per_token", "page_size", "kv_pages",
                                          "kv_capacity_tokens", "kv_scale_bytes")} == {
        "weight_bytes": 134_515_008 * 4, "kv_bytes_per_token": per_token, "page_size": 32, "kv_pages": pages,
        "kv_capacity_tokens": pages * 32, "kv_scale_bytes": 0}
    linear = 30 * (576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 3)
    assert payload["linear_weight_bytes"] == linear * 4
    assert payload["weight_bytes_by_dtype"]["bf16"]["linear"] == linear * 2
    assert payload["weight_bytes_by_dtype"]["fp8"]["linear"] == linear + 30 * (576 * 2 + 192 * 2 + 1536 * 2 + 576) * 4


def test_info_load_reports_what_the_built_engine_holds():
    """`--load` builds the engine: its pool is the pages the arithmetic promised (the CPU engine keeps no padding
    page: no graphs, the integrity check on the host) and its weights the bytes the file reader counted."""
    done = engine_cli("info", "--model", "smollm2-135m", "--memory-gib", "0.25", "--kv-dtype", "bf16", "--load",
                      "--device", "cpu", "--json")
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    [rank] = payload["ranks"]
    assert rank["kv_cache_bytes"] == payload["kv_pages"] * payload["page_size"] * payload["kv_bytes_per_token"]
    assert sum(rank["weight_bytes_by_component"].values()) == payload["weight_bytes"]
    assert "graph_bytes" not in rank


@pytest.fixture(scope="module")
def truncated_gguf(tmp_path_factory, smollm_path):
    path = tmp_path_factory.mktemp("bad") / "truncated.gguf"
    path.write_bytes(smollm_path.read_bytes()[:1_000_000])
    return path


BAD_INPUTS = {
    "empty prompt": (["--prompt", ""], "prompt is empty"),
    "prompt too long": (["--prompt", "word " * 9000, "--raw"], "context is 8192"),
    "unknown model": (["--model", "gpt-7", "--prompt", "hi"], "'gpt-7'"),
    "negative max tokens": (["--prompt", "hi", "--max-tokens", "-3"], "-3"),
    "page size 0": (["--prompt", "hi", "--page-size", "0"], "page_size"),
    "unknown kv dtype": (["--prompt", "hi", "--kv-dtype", "int2"], "'int2'"),
    "non-numeric max tokens": (["--prompt", "hi", "--max-tokens", "many"], "'many'"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(case):
    args, expected = BAD_INPUTS[case]
    done = engine_cli("generate", *args, "--json")
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_truncated_gguf_is_one_line_and_exit_2(truncated_gguf):
    done = engine_cli("generate", "--model", str(truncated_gguf), "--prompt", "hi")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "truncated or corrupt" in lines[0] and str(truncated_gguf) in lines[0]
