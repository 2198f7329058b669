"""Quantization primitives and quantized layers against their float references, on fresh random inputs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.core.errors import ConfigError
from engine.core.memory import WeightFormat
from engine.model.quant import (
    FP8_MAX,
    dequantize_fp8,
    dequantize_int4,
    fp8_per_head_scale,
    fp8_per_tensor_scale,
    int4_from_gguf_q4_1,
    pack_int4,
    quantize_fp8,
    quantize_fp8_weight,
    quantize_int4,
    unpack_int4,
)
from engine.model.quantized_linear import Fp8Linear, Int4Linear, linear_weight_bytes, quantize_linears


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("shape", [(7, 3, 64), (33, 1, 16), (1, 9, 128)])
def test_fp8_round_trip(shape):
    x = torch.randn(shape) * torch.rand(shape[1])[None, :, None] * 10
    for scale in (fp8_per_tensor_scale(x), fp8_per_head_scale(x)[None, :, None]):
        back = dequantize_fp8(quantize_fp8(x, scale), scale)
        assert not torch.isnan(back).any()
        assert relative_error(back, x) < 0.04
        assert ((back - x).abs() <= x.abs() * 2 ** -4 + scale * 2 ** -9).all()    # e4m3: 3 mantissa bits
    assert fp8_per_head_scale(x).shape == (shape[1],)


def test_fp8_saturates_instead_of_overflowing():
    scale = torch.tensor(1.0)
    q = quantize_fp8(torch.tensor([1e6, -1e6, 3.0]), scale)
    assert dequantize_fp8(q, scale).tolist() == [FP8_MAX, -FP8_MAX, 3.0]


def test_int4_pack_round_trip():
    q = torch.randint(0, 16, (5, 64))
    packed = pack_int4(q)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed).long(), q)
    assert int(packed[0, 0]) == int(q[0, 0]) | (int(q[0, 1]) << 4)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_round_to_nearest_error_is_half_a_step(group_size, symmetric):
    w = torch.randn(48, 256)
    fmt = WeightFormat("int4", group_size, symmetric)
    plain = quantize_int4(w, fmt, search=False)
    back = dequantize_int4(plain)
    step = plain.scales.float().repeat_interleave(group_size, dim=1)
    minimum = plain.group_minimums().float().repeat_interleave(group_size, dim=1)
    fp16_rounding = (minimum.abs() + 15 * step) * 2 ** -10       # scales and minimums are stored in fp16
    assert ((back - w).abs() <= step * 0.5 + fp16_rounding).all()
    searched = dequantize_int4(quantize_int4(w, fmt, search=True))
    assert ((searched - w) ** 2).sum() <= ((back - w) ** 2).sum()
    assert plain.minimums is None if symmetric else plain.minimums.shape == (48, 256 // group_size)


def test_bad_formats_are_rejected():
    with pytest.raises(ConfigError, match="does not divide the input dimension 576"):
        quantize_int4(torch.randn(8, 576), WeightFormat("int4", 128))
    with pytest.raises(ConfigError, match="group size"):
        WeightFormat("int4", 48)
    with pytest.raises(ConfigError, match="'int3'"):
        WeightFormat("int3")


def test_gguf_q4_1_moves_bits_exactly(smollm_path):
    from gguf.quants import dequantize

    from engine.model.loader import _read_gguf

    reader, _ = _read_gguf(smollm_path)
    tensor = next(t for t in reader.tensors if t.tensor_type.name == "Q4_1")
    out_features, in_features = int(tensor.shape[1]), int(tensor.shape[0])
    ours = int4_from_gguf_q4_1(torch.from_numpy(tensor.data.copy()), out_features, in_features)
    expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type))
    assert torch.equal(dequantize_int4(ours), expected)
    assert ours.scales.dtype == torch.float16 and ours.group_size == 32


@pytest.mark.parametrize("rows", [1, 3, 16, 33, 100])
@pytest.mark.parametrize("shape", [(96, 64), (40, 256)])
def test_int4_linear_matches_reference(rows, shape):
    weight = quantize_int4(torch.randn(shape), WeightFormat("int4", 32))
    layer = Int4Linear(weight)
    x = torch.randn(rows, shape[1])
    out = layer(x)
    reference = F.linear(x, dequantize_int4(weight))
    assert out.shape == (rows, shape[0]) and not torch.isnan(out).any()
    kernel_path = shape[0] % 16 == 0       # torch's CPU int4 kernel rounds activations to bf16
    assert relative_error(out, reference) < (1e-2 if kernel_path else 1e-5)


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_fp8_linear_matches_reference(rows):
    w = torch.randn(72, 48)
    layer = Fp8Linear(quantize_fp8_weight(w))
    x = torch.randn(rows, 48)
    assert relative_error(layer(x), F.linear(x, w)) < 0.04


def test_swap_replaces_decoder_linears_and_bytes_match_the_memory_model():
    from engine.core.memory import decoder_linear_bytes
    from engine.core.spec import DECODER_COMPONENTS, spec_from_config
    from engine.model.architectures.llama import LlamaModel

    config = spec_from_config({"model_type": "llama", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "max_position_embeddings": 64, "tie_word_embeddings": True}, "tiny")
    for fmt in (WeightFormat("int4", 32), WeightFormat("int4", 64, symmetric=True), WeightFormat("fp8")):
        model = quantize_linears(LlamaModel(config), fmt)
        kinds = {type(m).__name__ for m in model.modules()}
        assert "Linear" not in kinds
        assert linear_weight_bytes(model) == decoder_linear_bytes(config, dict.fromkeys(DECODER_COMPONENTS, fmt), "fp32")


def test_fp8_on_a_torch_without_it_is_a_clear_error(monkeypatch):
    import engine.model.quant as quant

    monkeypatch.setattr(quant, "FP8_DTYPE", None)
    with pytest.raises(ConfigError, match="has no float8_e4m3fn"):
        quant.quantize_fp8(torch.ones(2), torch.tensor(1.0))
