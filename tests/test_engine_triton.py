"""The engine's GPU path (Triton attention, KV write and quantized GEMMs) run on CPU in the interpreter.

A tiny random-weight model keeps the interpreter fast. FP8 KV is left to tests/gpu: the interpreter's
fp32 -> e4m3 conversion loses the carry at powers of two (see test_kernels.test_kv_write), which changes
real values; CUDA converts in hardware."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import triton  # noqa: F401  (a test dependency: a broken install fails here, never skips)

from engine.core.memory import WeightFormat
from engine.core.sequence import SamplingParams
from engine.kernels import kv_write, paged_attention
from engine.kernels.backend import ENV_VARIABLE
from engine.llm import LLM
from engine.model.quant import dequantize_fp8_weight, dequantize_int4, quantize_fp8_weight, quantize_int4
from engine.model.quantized_linear import Fp8Linear, Int4Linear

TINY = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True}


def test_triton_attention_and_kv_write_give_the_torch_tokens(monkeypatch, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    llm = LLM(model=str(path), num_pages=32, page_size=8, seed=1)
    prompts = [list(range(3, 14)), list(range(40, 60)), [7, 8, 9]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    torch_tokens = [r.token_ids for r in llm.generate(prompts, params)]
    calls = {"paged_decode_attention": 0, "kv_write": 0}
    for module in (paged_attention, kv_write):
        name = next(n for n in calls if hasattr(module, n))
        original = getattr(module, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    monkeypatch.setenv(ENV_VARIABLE, "triton")
    assert [r.token_ids for r in llm.generate(prompts, params)] == torch_tokens
    assert calls["kv_write"] >= 10 * 2 and calls["paged_decode_attention"] >= 9 * 2   # steps x layers


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_quantized_layers_take_the_triton_gemms(monkeypatch, rows):
    monkeypatch.setenv(ENV_VARIABLE, "triton")
    w = torch.randn(96, 128)
    x = torch.randn(rows, 128)
    int4 = quantize_int4(w, WeightFormat("int4", 32))
    fp8 = quantize_fp8_weight(w)
    for layer, dense in ((Int4Linear(int4), dequantize_int4(int4)), (Fp8Linear(fp8), dequantize_fp8_weight(fp8))):
        out, expected = layer(x), F.linear(x, dense)
        assert ((out - expected).norm() / expected.norm()).item() < 1e-5


def device_checked_workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Eight prompts sharing a 16-token opening (2 pages of 8): the sharing faults find shared pages."""
    import random

    rng = random.Random(seed)
    opening = rng.choices(range(512), k=16)
    prompts = [opening + rng.choices(range(512), k=rng.randrange(3, 40)) for _ in range(8)]
    return prompts, [SamplingParams(max_tokens=rng.randrange(4, 10), ignore_eos=True) for _ in prompts]


def test_the_device_integrity_check_catches_every_ownership_fault_and_harms_nobody(monkeypatch, tmp_path):
    """With Triton on (here the interpreter), the step's ownership check is one kernel in the step: a flagged
    request's writes go to the padding page, its token is dropped and it is aborted; the others answer as without
    the fault."""
    from campaign import assert_campaign_detects

    from engine.harness.fault_campaign import OWNERSHIP_FAULTS

    monkeypatch.setenv(ENV_VARIABLE, "triton")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    with LLM(model=str(path), num_pages=96, page_size=8, seed=1, integrity="ownership") as llm:
        assert llm.core.integrity.on_device and llm.core.worker.runner.pad_page == 95
        assert llm.stats().num_pages == 95          # the padding page is nobody's
        runner, raised = llm.core.worker.runner, []
        check = runner.device_check

        def counted(step, pad_slot):
            flags = check(step, pad_slot)
            raised.append(int((flags != 0).sum()))
            return flags

        runner.device_check = counted
        assert_campaign_detects(llm, device_checked_workload(4), OWNERSHIP_FAULTS, 1, seed=4)
        assert len(raised) > 40 and sum(raised) >= 3      # the kernel ran in every step and caught faults itself


def test_full_mode_on_the_device_catches_a_flipped_bit_and_a_shared_write(monkeypatch, tmp_path):
    """`full` mode on the device: the checksums of the sealed pages a step reads are computed in the step and
    flag the request reading a flipped bit; a write into a shared page is flagged by the kernel."""
    from campaign import assert_campaign_detects

    monkeypatch.setenv(ENV_VARIABLE, "triton")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    with LLM(model=str(path), num_pages=96, page_size=8, seed=1, integrity="full") as llm:
        assert llm.core.integrity.on_device
        assert_campaign_detects(llm, device_checked_workload(5), ("bit_flip", "shared_write"), 1, seed=5)
