"""The paged KV pool: per layer, `num_pages` pages of `page_size` token slots for K and for V.

    keys[layer]: [num_pages, page_size, num_kv_heads, head_dim]   (values alike)

Token slot `s` of the flat pool is page `s // page_size`, offset `s % page_size`; the block manager
decides which slots a sequence owns, this class only stores and hands out the bytes.
"""
from __future__ import annotations

import torch

from engine.memory import KVLayout, kv_bytes_per_page

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class PagedKVCache:
    def __init__(self, layout: KVLayout, num_pages: int, page_size: int, device: torch.device | str) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (layout.num_layers, num_pages, page_size, layout.num_kv_heads, layout.head_dim)
        dtype = TORCH_DTYPES[layout.dtype]
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes actually allocated; equals the memory model's figure by construction (tested)."""
        return self.keys.nbytes + self.values.nbytes

    @property
    def expected_nbytes(self) -> int:
        return self.num_pages * kv_bytes_per_page(self.layout, self.page_size)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer], self.values[layer]

    def write(self, layer: int, slot_mapping: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stores new tokens' K/V ([T, kv_heads, head_dim]) at their flat slots."""
        self.keys[layer].view(-1, *keys.shape[1:])[slot_mapping] = keys.to(self.keys.dtype)
        self.values[layer].view(-1, *values.shape[1:])[slot_mapping] = values.to(self.values.dtype)
