"""Disaggregated serving's pages in flight on one engine: prefills that leave with their prompt's pages
(`hand_off`), and arrivals from a prefill replica, whose pages are written when the scheduler admits them (`fill`)
after their checksums, taken before sending, are verified."""
from __future__ import annotations

import logging

from engine.core.errors import RequestError
from engine.core.handoff import KVHandoff
from engine.core.memory import KVLayout, pages_for_tokens
from engine.core.sequence import SamplingParams, Sequence
from engine.model.kv_cache import PagedKVCache

log = logging.getLogger("engine.executor.integrity")


class Handoffs:
    def __init__(self, kv_cache: PagedKVCache, layout: KVLayout, page_size: int) -> None:
        self.kv_cache = kv_cache
        self.layout = layout
        self.page_size = page_size
        self.corruptions = 0                # arrivals with a page failing its checksum
        self._arrivals: dict[int, KVHandoff] = {}            # queued, not admitted yet: their pages
        self._params: dict[int, SamplingParams] = {}         # prefills that hand off: the request's own params
        self._finished: list[Sequence] = []                  # arrivals whose first token already ended them

    def departs(self, seq: Sequence, params: SamplingParams) -> None:
        """A prefill that ends with its pages copied out for a decode replica, which decodes under `params`."""
        seq.keeps_pages = True
        self._params[seq.seq_id] = params

    def check_compatible(self, handoff: KVHandoff) -> None:
        """RequestError if the hand-off was computed for another cache: layout, page size, FP8 scales."""
        if handoff.layout != self.layout:
            raise RequestError(f"the hand-off was computed for the KV layout {handoff.layout}; this engine's is "
                               f"{self.layout}")
        if handoff.page_size != self.page_size:
            raise RequestError(f"the hand-off has pages of {handoff.page_size} tokens; this engine's hold "
                               f"{self.page_size}")
        if handoff.scales_digest != self.kv_cache.scales_digest():
            raise RequestError("the hand-off's FP8 KV scales differ from this engine's: its pages would mean other "
                               "values here")

    def arrives(self, seq: Sequence, handoff: KVHandoff) -> bool:
        """Keeps an arrival's pages until it is admitted; False if its first token already ended it (it answers at
        the next step without being scheduled)."""
        if seq.is_finished:
            self._finished.append(seq)
            return False
        self._arrivals[seq.seq_id] = handoff
        return True

    def has_finished_arrivals(self) -> bool:
        return bool(self._finished)

    def take_finished_arrivals(self) -> list[Sequence]:
        finished, self._finished = self._finished, []
        return finished

    def fill(self, seq: Sequence, table: list[int]) -> list[int] | None:
        """Writes an admitted arrival's pages into its table; the full pages written (to seal), or None if a page
        fails the checksum taken before sending (nothing is written; the caller aborts the request)."""
        handoff = self._arrivals.pop(seq.seq_id)
        corrupt = handoff.corrupt_pages()
        if corrupt:
            log.error("integrity violation: request %d: page %d of its hand-off fails the checksum taken before "
                      "sending", seq.seq_id, corrupt[0])
            self.corruptions += 1
            return None
        pages = table[:handoff.num_pages]
        self.kv_cache.import_pages(pages, handoff.payload)
        return pages[:seq.num_prompt_tokens // self.page_size]

    def hand_off(self, seq: Sequence, table: list[int]) -> KVHandoff:
        """Copies a finished prefill's prompt pages out, with their checksums, for its decode replica."""
        pages = table[:pages_for_tokens(seq.num_prompt_tokens, self.page_size)]
        return KVHandoff.of_pages(seq.prompt_token_ids, seq.output_token_ids[0], self._params[seq.seq_id],
                                  self.layout, self.page_size, self.kv_cache.scales_digest(),
                                  self.kv_cache.export_pages(pages), seq.cache_salt)

    def pages_out(self, pages: list[int]) -> KVHandoff:
        """`pages` copied out as a hand-off of as many tokens (`LLM.copy_pages_out`)."""
        return KVHandoff.of_pages(list(range(len(pages) * self.page_size)), 0, SamplingParams(), self.layout,
                                  self.page_size, self.kv_cache.scales_digest(), self.kv_cache.export_pages(pages))

    def pages_in(self, handoff: KVHandoff, pages: list[int]) -> None:
        """A hand-off's pages checked and written into `pages` (`LLM.copy_pages_in`)."""
        handoff.corrupt_pages()
        self.kv_cache.import_pages(pages, handoff.payload)

    def close(self) -> None:
        """Lets go of the pool and of the pages in flight (a closed engine holds no memory); the counts stay."""
        self.kv_cache = None
        self._arrivals, self._params, self._finished = {}, {}, []

    def forget(self, seq_id: int) -> None:
        """A request ended: whatever it left here goes."""
        self._arrivals.pop(seq_id, None)
        self._params.pop(seq_id, None)
