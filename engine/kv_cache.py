"""The paged KV pool: per layer, `num_pages` pages of `page_size` token slots for K and for V.

    keys[layer]: [num_pages, page_size, num_kv_heads, head_dim]   (values alike)

Token slot `s` of the flat pool is page `s // page_size`, offset `s % page_size`; the block manager
decides which slots a sequence owns, this class only stores and hands out the bytes.

FP8 pages hold e4m3 values; one static scale per (layer, KV head) for K and one for V, either given or
calibrated on a warm-up prefill (`calibrating`): then each layer's write sets its scales to the data's
amax / 448, and later writes saturate at ±448 · scale. (Measured on SmolLM2: 2x headroom over the
calibration amax cost +0.4% perplexity, more than the rare clipping it avoids.)
"""
from __future__ import annotations

import torch

from engine.dtypes import TORCH_DTYPES
from engine.kernel_backend import use_triton
from engine.memory import KVLayout, kv_cache_bytes
from engine.quant import fp8_per_head_scale, quantize_fp8, require_fp8


class PagedKVCache:
    def __init__(self, layout: KVLayout, num_pages: int, page_size: int, device: torch.device | str) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = page_size
        self.is_fp8 = layout.dtype == "fp8"
        shape = (layout.num_layers, num_pages, page_size, layout.num_kv_heads, layout.head_dim)
        if self.is_fp8:
            dtype = require_fp8()
            scales = torch.ones(layout.num_layers, layout.num_kv_heads, dtype=torch.float32, device=device)
            self.key_scales, self.value_scales = scales, scales.clone()
        else:
            dtype = TORCH_DTYPES[layout.dtype]
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.calibrating = False

    @property
    def nbytes(self) -> int:
        """Bytes actually allocated; equals the memory model's figure by construction (tested)."""
        scales = self.key_scales.nbytes + self.value_scales.nbytes if self.is_fp8 else 0
        return self.keys.nbytes + self.values.nbytes + scales

    @property
    def expected_nbytes(self) -> int:
        return kv_cache_bytes(self.layout, self.num_pages, self.page_size)

    def set_scales(self, key_scales: torch.Tensor, value_scales: torch.Tensor) -> None:
        """Given FP8 scales, [num_layers, num_kv_heads] each."""
        expected = (self.layout.num_layers, self.layout.num_kv_heads)
        for name, scales in (("key", key_scales), ("value", value_scales)):
            if tuple(scales.shape) != expected or not bool((scales > 0).all()):
                raise ValueError(f"{name} scales must be positive with shape {expected}, got {tuple(scales.shape)}")
        self.key_scales.copy_(key_scales)
        self.value_scales.copy_(value_scales)

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.is_fp8:
            return None, None
        return self.key_scales[layer], self.value_scales[layer]

    def write(self, layer: int, slot_mapping: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stores new tokens' K/V ([T, kv_heads, head_dim]) at their flat slots (Triton on CUDA)."""
        if self.is_fp8 and self.calibrating:
            self.key_scales[layer] = fp8_per_head_scale(keys)
            self.value_scales[layer] = fp8_per_head_scale(values)
        if use_triton(keys):
            from kernels.kv_write import kv_write

            kv_write(keys, values, self.keys[layer], self.values[layer], slot_mapping, *self.layer_scales(layer))
            return
        if self.is_fp8:
            keys = quantize_fp8(keys, self.key_scales[layer][None, :, None])
            values = quantize_fp8(values, self.value_scales[layer][None, :, None])
        self.keys[layer].view(-1, *keys.shape[1:])[slot_mapping] = keys.to(self.keys.dtype)
        self.values[layer].view(-1, *values.shape[1:])[slot_mapping] = values.to(self.values.dtype)

    def gather(self, layer: int, pages: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given pages ([..., page_size, kv_heads, head_dim] per index), dequantized to `dtype`."""
        keys, values = self.keys[layer][pages].to(dtype), self.values[layer][pages].to(dtype)
        if self.is_fp8:                                  # in place: the converted copy is ours alone
            keys.mul_(self.key_scales[layer][:, None].to(dtype))
            values.mul_(self.value_scales[layer][:, None].to(dtype))
        return keys, values
