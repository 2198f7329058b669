"""What an engine reports about itself between steps: its queues, its KV pool, and the counters a server exports.
Torch-free: a server, a verification or a bench reads these instead of the engine's parts."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    running: int                    # requests in the batch (decoding, or computing their prompt)
    waiting: int                    # queued requests and hand-offs not admitted yet
    num_pages: int                  # the KV pool
    free_pages: int                 # on the free list (cached pages no request holds included)
    used_pages: int                 # held by requests, or quarantined
    cached_pages: int               # published pages no request holds: reusable by a prefix hit until evicted
    quarantined_pages: int          # taken out for good after an integrity violation
    page_size: int
    preemptions: int
    prefix_queried_tokens: int      # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int          # of them, found
    draft_tokens: int               # speculative tokens verified
    accepted_tokens: int            # of them, those that stood
    integrity_detections: int       # refused prefix-cache hits (aborts are counted by the requests' finish reason)
    handoff_corruptions: int        # hand-offs that arrived with a page failing its checksum

    @property
    def held_pages(self) -> int:
        """Pages requests hold: used pages less the quarantined ones, which no request holds."""
        return self.used_pages - self.quarantined_pages

    @property
    def usable_tokens(self) -> int:
        """The pool's token slots less its quarantined pages'."""
        return (self.num_pages - self.quarantined_pages) * self.page_size
