"""KV write in Triton: new tokens' K/V go to their flat slots, quantized to FP8 when the pages are FP8."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import check, check_tensor, next_power_of_2
from engine.kernels.paged_attention import FLOAT_DTYPES, PAGE_DTYPES
from engine.kernels.reference import FP8_MAX


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, k_pages_ptr, v_pages_ptr, slots_ptr, k_scale_ptr, v_scale_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_page, stride_slot, stride_kvh,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     FP8: tl.constexpr, FP8_LIMIT: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    slot = tl.load(slots_ptr + token).to(tl.int64)
    destination = (slot // PAGE_SIZE) * stride_page + (slot % PAGE_SIZE) * stride_slot + head * stride_kvh + d
    keys = tl.load(k_ptr + token * stride_kt + head * stride_kh + d, mask=d_ok, other=0.0).to(tl.float32)
    values = tl.load(v_ptr + token * stride_vt + head * stride_vh + d, mask=d_ok, other=0.0).to(tl.float32)
    if FP8:
        keys = tl.clamp(keys / tl.load(k_scale_ptr + head), -FP8_LIMIT, FP8_LIMIT)
        values = tl.clamp(values / tl.load(v_scale_ptr + head), -FP8_LIMIT, FP8_LIMIT)
    tl.store(k_pages_ptr + destination, keys.to(k_pages_ptr.dtype.element_ty), mask=d_ok)
    tl.store(v_pages_ptr + destination, values.to(v_pages_ptr.dtype.element_ty), mask=d_ok)


def kv_write(keys: torch.Tensor, values: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
             slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
             v_scales: torch.Tensor | None = None) -> None:
    """Same contract as `engine.kernels.reference.kv_write`."""
    device = keys.device
    check_tensor("keys", keys, 3, FLOAT_DTYPES, device)
    check_tensor("values", values, 3, FLOAT_DTYPES, device)
    check_tensor("key_pages", key_pages, 4, PAGE_DTYPES, device)
    check_tensor("value_pages", value_pages, 4, PAGE_DTYPES, device)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64), device)
    check(keys.shape == values.shape, f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ")
    check(key_pages.shape == value_pages.shape and key_pages.stride() == value_pages.stride(),
          "key and value pages must match")
    tokens, num_kv_heads, head_dim = keys.shape
    check(tuple(key_pages.shape[2:]) == (num_kv_heads, head_dim),
          f"pages hold {tuple(key_pages.shape[2:])} per slot, new K/V are {(num_kv_heads, head_dim)}")
    check(slot_mapping.shape[0] == tokens, f"{slot_mapping.shape[0]} slots for {tokens} tokens")
    fp8 = key_pages.dtype == torch.float8_e4m3fn
    check(fp8 == (k_scales is not None) == (v_scales is not None),
          "FP8 pages need k_scales and v_scales; float pages take none")
    if tokens == 0:
        return
    dummy = torch.ones(1, dtype=torch.float32, device=device)
    _kv_write_kernel[(tokens, num_kv_heads)](
        keys, values, key_pages, value_pages, slot_mapping,
        k_scales if fp8 else dummy, v_scales if fp8 else dummy,
        keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        key_pages.stride(0), key_pages.stride(1), key_pages.stride(2),
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), PAGE_SIZE=key_pages.shape[1], FP8=fp8,
        FP8_LIMIT=FP8_MAX)
