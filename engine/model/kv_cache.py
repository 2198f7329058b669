"""The paged cache pool: per layer, `num_pages` pages of `page_size` token slots.

    GQA  pools (keys, values), each [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    MLA  pools (latents,)           [num_layers, num_pages, page_size, latent_dim + rope_dim]
                                     one row per token: the normalized latent, then the rotated rope key

Token slot `s` of the flat pool is page `s // page_size`, offset `s % page_size`; the block manager
decides which slots a sequence owns, this class only stores and hands out the bytes.

FP8 pages hold e4m3 values with static fp32 scales per layer: GQA one per KV head for K and one for V,
MLA one for the latent and one for the rope key. They are given, or calibrated on a warm-up prefill
(`calibrating`): then each layer's write sets its scales to the data's amax / 448, and later writes saturate
at ±448 · scale. (Measured on SmolLM2: 2x headroom over the calibration amax cost +0.4% perplexity, more
than the rare clipping it avoids.) Static scales keep a page exactly `page_size` x elements bytes, so FP8
holds twice the tokens of BF16 less a few bytes of scales.

A DSA model's indexer keys sit under the same pages, one row per token in each layer with its own indexer:

    indexer keys     [indexer_layers, num_pages, page_size, indexer_dim]
    indexer scales   [indexer_layers, num_pages, page_size] fp32, FP8 only: one per token (amax / 448)

They follow the latent pools in `pools`, so whatever walks the pages (integrity checksums, fault injection,
the profiler's tiling) covers them too.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.core.handoff import checksum
from engine.core.memory import KVLayout, kv_cache_bytes
from engine.kernels.backend import use_triton
from engine.model.dtypes import TORCH_DTYPES
from engine.model.quant import fp8_per_head_scale, fp8_scale, quantize_fp8, require_fp8


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A pool of zeros. On a CPU its pages become resident only as they are written: numpy's zeros come from calloc,
    whose large blocks are fresh zero pages of the operating system, where torch.zeros writes every byte (an engine
    with the default 1 GiB pool held 1 GiB from its first step; a test suite builds dozens)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = int(np.prod(shape, dtype=np.int64))
    raw = torch.from_numpy(np.zeros(count * torch.empty((), dtype=dtype).element_size(), dtype=np.uint8))
    return raw.view(dtype).view(shape)


class PagedKVCache:
    def __init__(self, layout: KVLayout, num_pages: int, page_size: int, device: torch.device | str) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = page_size
        self.is_fp8 = layout.dtype == "fp8"
        dtype = require_fp8() if self.is_fp8 else TORCH_DTYPES[layout.dtype]
        if layout.kind == "mla":
            row = (layout.latent_dim + layout.rope_dim,)
            scale_shapes = [(layout.num_layers, 2)]
        else:
            row = (layout.num_kv_heads, layout.head_dim)
            scale_shapes = [(layout.num_layers, layout.num_kv_heads)] * 2
        self.pools = tuple(zeroed_pool((layout.num_layers, num_pages, page_size, *row), dtype, device)
                           for _ in scale_shapes)
        if layout.indexer_layers:
            index_pages = (layout.indexer_layers, num_pages, page_size)
            self.pools += (zeroed_pool((*index_pages, layout.indexer_dim), dtype, device),)
            if self.is_fp8:
                self.pools += (torch.ones(index_pages, dtype=torch.float32, device=device),)
        self.scales = tuple(torch.ones(shape, dtype=torch.float32, device=device)
                            for shape in scale_shapes) if self.is_fp8 else ()
        self.calibrating = False

    @property
    def device(self) -> torch.device:
        return self.pools[0].device

    @property
    def keys(self) -> torch.Tensor:
        return self.pools[0]

    @property
    def values(self) -> torch.Tensor:
        return self.pools[1]

    @property
    def latents(self) -> torch.Tensor:
        return self.pools[0]

    @property
    def index_keys(self) -> torch.Tensor:
        return self.pools[1]

    @property
    def index_key_scales(self) -> torch.Tensor | None:
        """The indexer keys' per-token scales (FP8 pages only)."""
        return self.pools[2] if self.is_fp8 else None

    @property
    def nbytes(self) -> int:
        """Bytes actually allocated; equals the memory model's figure by construction (tested)."""
        return sum(pool.nbytes for pool in self.pools) + sum(scale.nbytes for scale in self.scales)

    @property
    def expected_nbytes(self) -> int:
        return kv_cache_bytes(self.layout, self.num_pages, self.page_size)

    def set_scales(self, *scales: torch.Tensor) -> None:
        """Given FP8 scales: GQA key and value scales [num_layers, num_kv_heads]; MLA [num_layers, 2]."""
        if len(scales) != len(self.scales):
            raise ValueError(f"expected {len(self.scales)} scale tensors, got {len(scales)}")
        for given, own in zip(scales, self.scales):
            if given.shape != own.shape or not bool((given > 0).all()):
                raise ValueError(f"scales must be positive with shape {tuple(own.shape)}, got {tuple(given.shape)}")
        for given, own in zip(scales, self.scales):
            own.copy_(given)

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, ...]:
        if not self.is_fp8:
            return (None,) * len(self.pools)
        return tuple(scale[layer] for scale in self.scales)

    def write(self, layer: int, slot_mapping: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stores new tokens' K/V ([T, kv_heads, head_dim]) at their flat slots (Triton on CUDA)."""
        if self.is_fp8 and self.calibrating:
            self.scales[0][layer] = fp8_per_head_scale(keys)
            self.scales[1][layer] = fp8_per_head_scale(values)
        if use_triton(keys):
            from engine.kernels.kv_write import kv_write

            kv_write(keys, values, self.keys[layer], self.values[layer], slot_mapping, *self.layer_scales(layer))
            return
        if self.is_fp8:
            keys = quantize_fp8(keys, self.scales[0][layer][None, :, None])
            values = quantize_fp8(values, self.scales[1][layer][None, :, None])
        self.keys[layer].view(-1, *keys.shape[1:])[slot_mapping] = keys.to(self.keys.dtype)
        self.values[layer].view(-1, *values.shape[1:])[slot_mapping] = values.to(self.values.dtype)

    def gather(self, layer: int, pages: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given pages ([..., page_size, kv_heads, head_dim] per index), dequantized to `dtype`."""
        keys, values = self.keys[layer][pages].to(dtype), self.values[layer][pages].to(dtype)
        if self.is_fp8:                                  # in place: the converted copy is ours alone
            keys.mul_(self.scales[0][layer][:, None].to(dtype))
            values.mul_(self.scales[1][layer][:, None].to(dtype))
        return keys, values

    def latent_scale_row(self, layer: int) -> torch.Tensor:
        """The layer's two MLA scales spread over a cache row: the latent's, then the rope key's."""
        scales = self.scales[0][layer]
        return torch.cat([scales[0].expand(self.layout.latent_dim), scales[1].expand(self.layout.rope_dim)])

    def write_latent(self, layer: int, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
        """Stores new tokens' cache rows ([T, latent_dim + rope_dim]) at their flat slots."""
        if self.is_fp8:
            if self.calibrating:
                latent, rope = rows.abs().split([self.layout.latent_dim, self.layout.rope_dim], dim=-1)
                self.scales[0][layer] = fp8_scale(torch.stack([latent.amax(), rope.amax()]))
            rows = quantize_fp8(rows, self.latent_scale_row(layer))
        self.latents[layer].view(-1, rows.shape[-1])[slot_mapping] = rows.to(self.latents.dtype)

    def gather_latent(self, layer: int, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cache rows of the given pages ([..., page_size, latent_dim + rope_dim] per index) in `dtype`."""
        return self._latent_rows(layer, self.latents[layer][pages], dtype)

    def _latent_rows(self, layer: int, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gathered latent cache rows in `dtype`, dequantized where the pages are FP8."""
        rows = rows.to(dtype)
        if self.is_fp8:                                  # in place: the converted copy is ours alone
            rows.mul_(self.latent_scale_row(layer).to(dtype))
        return rows

    def write_index_keys(self, slot: int, slot_mapping: torch.Tensor, keys: torch.Tensor) -> None:
        """Stores new tokens' indexer keys ([T, indexer_dim]) in indexer row `slot`; FP8 with a scale per token."""
        pool = self.index_keys[slot].view(-1, keys.shape[-1])
        if self.is_fp8:
            scales = fp8_scale(keys.float().abs().amax(dim=-1))
            self.index_key_scales[slot].view(-1)[slot_mapping] = scales
            keys = quantize_fp8(keys, scales[:, None])
        pool[slot_mapping] = keys.to(pool.dtype)

    def gather_index_keys(self, slot: int, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Indexer keys of the given pages ([..., page_size, indexer_dim] per index) in `dtype`."""
        keys = self.index_keys[slot][pages].to(dtype)
        if self.is_fp8:
            keys.mul_(self.index_key_scales[slot][pages].to(dtype)[..., None])
        return keys

    def gather_latent_rows(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cache rows of the given flat token slots ([..., latent_dim + rope_dim] per slot) in `dtype`."""
        return self._latent_rows(layer, self.latents[layer].view(-1, self.latents.shape[-1])[slots], dtype)

    def export_pages(self, pages: list[int]) -> bytes:
        """The bytes of `pages`, page-major (each page's rows of every layer and pool together), for a hand-off."""
        index = torch.tensor(pages, dtype=torch.int64, device=self.device)
        parts = [pool[:, index].transpose(0, 1).reshape(len(pages), -1).view(torch.uint8) for pool in self.pools]
        return torch.cat(parts, dim=1).cpu().numpy().tobytes()

    def import_pages(self, pages: list[int], payload: bytes) -> None:
        """Writes `export_pages` bytes (of another pool of the same layout) into `pages` of this one."""
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(len(pages), -1).to(self.device)
        index = torch.tensor(pages, dtype=torch.int64, device=self.device)
        offset = 0
        for pool in self.pools:
            width = pool[:, 0].nbytes
            rows = data[:, offset:offset + width].contiguous().view(pool.dtype)
            pool[:, index] = rows.view(len(pages), pool.shape[0], *pool.shape[2:]).transpose(0, 1)
            offset += width

    def scales_digest(self) -> str:
        """A digest of the FP8 scales ("" without FP8 pages): a hand-off's pages mean the same only under the
        same scales."""
        if not self.is_fp8:
            return ""
        return checksum(b"".join(scale.cpu().numpy().tobytes() for scale in self.scales))

    def tile(self, written: list[int], max_tile_bytes: int = 256 << 20) -> None:
        """Copies the `written` pages over the whole pool, in tiles of at most `max_tile_bytes` per pool: the
        profiler's seeded decodes then read real K/V (zeros convert from FP8 faster than real values)."""
        index = torch.tensor(written, device=self.device)
        tile_pages = max(len(written), min(self.num_pages, max_tile_bytes // self.pools[0][:, 0].nbytes))
        for pool in self.pools:
            tile = pool[:, index].repeat(1, -(-tile_pages // len(written)), *[1] * (pool.dim() - 2))
            for start in range(0, self.num_pages, tile.shape[1]):
                count = min(tile.shape[1], self.num_pages - start)
                pool[:, start:start + count] = tile[:, :count]
