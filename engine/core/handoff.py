"""The KV hand-off of disaggregated serving: what a prefill replica sends its decode replica. Torch-free.

A prefill replica runs the prompt, samples the first token, copies the prompt's pages out of its pool (page-major:
page 0 of every layer and pool, then page 1 ...) and frees them; the decode replica checks every page against the
checksum taken before sending, writes the pages into pages of its own, granted to the request (ownership moves
with the pages), and goes on decoding. One frame on the wire:

    b"KVH1" | header length (4 bytes, big-endian) | header (JSON) | payload (num_pages x page_bytes)

The header names the request's tokens, its sampling settings and the cache it was computed for (layout, page
size, FP8 scales' digest), so a decode replica of another model or cache refuses it with a clear error instead of
decoding from foreign bytes.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.core.errors import RequestError
from engine.core.memory import KVLayout, handoff_bytes, pages_for_tokens
from engine.core.sequence import SamplingParams

MAGIC = b"KVH1"
LENGTH = struct.Struct(">I")
MEDIA_TYPE = "application/x-kvplan-handoff"


def checksum(data: bytes | memoryview) -> str:
    """A hand-off's checksum of bytes (a page's, the FP8 scales'): 64-bit BLAKE2b, so a flipped bit anywhere in
    them (any layer, any pool) shows."""
    return hashlib.blake2b(data, digest_size=8).hexdigest()


@dataclass(frozen=True)
class KVHandoff:
    """A computed prompt in transit: its tokens, the token the prefill sampled, and the pages of its KV."""

    prompt_token_ids: tuple[int, ...]
    first_token: int
    params: SamplingParams
    layout: KVLayout
    page_size: int
    scales_digest: str                   # of the prefill's FP8 scales ("" without FP8 pages)
    checksums: tuple[str, ...]           # one per page, taken before sending
    payload: bytes = field(repr=False)
    cache_salt: str | None = None
    request_id: str = ""

    def __post_init__(self) -> None:
        expected = handoff_bytes(self.layout, len(self.prompt_token_ids), self.page_size)
        if len(self.payload) != expected:
            raise RequestError(f"a hand-off of {len(self.prompt_token_ids)} prompt tokens carries "
                               f"{len(self.payload)} bytes of pages; its cache needs {expected}")
        if len(self.checksums) != self.num_pages:
            raise RequestError(f"a hand-off of {self.num_pages} pages carries {len(self.checksums)} checksums")

    @classmethod
    def of_pages(cls, prompt_token_ids: list[int], first_token: int, params: SamplingParams, layout: KVLayout,
                 page_size: int, scales_digest: str, payload: bytes, cache_salt: str | None = None,
                 request_id: str = "") -> KVHandoff:
        """A hand-off of pages just copied out, with their checksums taken now (before sending)."""
        page_bytes = len(payload) // max(1, pages_for_tokens(len(prompt_token_ids), page_size))
        view = memoryview(payload)
        checksums = tuple(checksum(view[start:start + page_bytes])
                          for start in range(0, len(payload), page_bytes))
        return cls(tuple(prompt_token_ids), first_token, params, layout, page_size, scales_digest, checksums,
                   payload, cache_salt, request_id)

    @property
    def num_pages(self) -> int:
        return pages_for_tokens(len(self.prompt_token_ids), self.page_size)

    @property
    def page_bytes(self) -> int:
        return len(self.payload) // self.num_pages

    def page(self, index: int) -> memoryview:
        return memoryview(self.payload)[index * self.page_bytes:(index + 1) * self.page_bytes]

    def corrupt_pages(self) -> list[int]:
        """The pages whose bytes no longer match the checksums taken before sending."""
        return [index for index, taken in enumerate(self.checksums) if checksum(self.page(index)) != taken]

    def header(self) -> dict[str, Any]:
        return {"prompt_token_ids": list(self.prompt_token_ids), "first_token": self.first_token,
                "params": asdict(self.params), "layout": asdict(self.layout), "page_size": self.page_size,
                "scales_digest": self.scales_digest, "checksums": list(self.checksums),
                "cache_salt": self.cache_salt, "request_id": self.request_id}

    def encode(self) -> bytes:
        header = json.dumps(self.header()).encode()
        return MAGIC + LENGTH.pack(len(header)) + header + self.payload

    @classmethod
    def decode(cls, frame: bytes) -> KVHandoff:
        """A frame back into a hand-off; RequestError naming what is wrong with a malformed one."""
        if frame[:4] != MAGIC or len(frame) < 8:
            raise RequestError(f"not a KV hand-off frame (starts with {bytes(frame[:4])!r}, expected {MAGIC!r})")
        (length,) = LENGTH.unpack(frame[4:8])
        try:
            header = json.loads(frame[8:8 + length])
            params = header["params"]
            params["stop_token_ids"] = tuple(params["stop_token_ids"])
            return cls(tuple(header["prompt_token_ids"]), header["first_token"], SamplingParams(**params),
                       KVLayout(**header["layout"]), header["page_size"], header["scales_digest"],
                       tuple(header["checksums"]), bytes(frame[8 + length:]), header["cache_salt"],
                       header["request_id"])
        except (ValueError, KeyError, TypeError) as error:
            raise RequestError(f"a malformed KV hand-off header: {error}") from None
