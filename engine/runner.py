"""Runs one scheduled step on the model: flat inputs, block tables, forward, sampling."""
from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, PrefillChunk, chunk_causal_mask, decode_mask
from engine.block_manager import BlockManager
from engine.kv_cache import PagedKVCache
from engine.memory import pages_for_tokens
from engine.models.base import DecoderModel
from engine.sampler import sample
from engine.scheduler import ScheduledSequence, SchedulerOutput


class ModelRunner:
    def __init__(self, model: DecoderModel, kv_cache: PagedKVCache, block_manager: BlockManager,
                 seed: int = 0) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_manager = block_manager
        self.device = next(model.parameters()).device
        self.seed = seed
        self._generators: dict[int, torch.Generator] = {}

    def _generator(self, item: ScheduledSequence) -> torch.Generator | None:
        seq = item.seq
        if seq.params.greedy:
            return None
        if seq.seq_id not in self._generators:
            seed = seq.params.seed if seq.params.seed is not None else self.seed * 1_000_003 + seq.seq_id
            self._generators[seq.seq_id] = torch.Generator(device=self.device).manual_seed(seed)
        return self._generators[seq.seq_id]

    def release(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def prepare(self, items: list[ScheduledSequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat token ids, positions and attention metadata; `items` must list decodes first."""
        page_size = self.block_manager.page_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for item in items:
            table = self.block_manager.block_table(item.seq.seq_id)
            token_ids.extend(item.seq.token_ids_between(item.start, item.end))
            span = range(item.start, item.end)
            positions.extend(span)
            slots.extend(table[p // page_size] * page_size + p % page_size for p in span)
            if item.is_decode:
                decode_tables.append(table)
                decode_lens.append(item.end)
            else:
                pages = table[:pages_for_tokens(item.end, page_size)]
                prefills.append(PrefillChunk(len(token_ids) - item.num_new_tokens, item.num_new_tokens,
                                             item.end, self._tensor(pages),
                                             chunk_causal_mask(item.num_new_tokens, item.end, self.device)))
        width = max((len(t) for t in decode_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in decode_tables]
        context_lens = self._tensor(decode_lens)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decodes=len(decode_tables),
            decode_block_tables=self._tensor(padded).reshape(len(decode_tables), width),
            decode_context_lens=context_lens,
            decode_mask=decode_mask(context_lens, width, page_size),
            prefills=tuple(prefills),
        )
        return self._tensor(token_ids), self._tensor(positions), meta

    @torch.inference_mode()
    def logits(self, items: list[ScheduledSequence]) -> torch.Tensor:
        """Logits of every computed position, float32 [T, vocab]; for scoring, not serving."""
        input_ids, positions, meta = self.prepare(sorted(items, key=lambda item: not item.is_decode))
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_cache, meta))

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> dict[int, int]:
        """Runs the step; returns the sampled token of every sequence that reached its last token."""
        items = sorted(output.scheduled, key=lambda item: not item.is_decode)
        input_ids, positions, meta = self.prepare(items)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        sampling = [(row, item) for row, item in zip(_last_rows(items), items) if item.samples]
        if not sampling:
            return {}
        rows = self._tensor([row for row, _ in sampling])
        logits = self.model.compute_logits(hidden[rows])
        tokens = sample(logits, [item.seq.params for _, item in sampling],
                        [self._generator(item) for _, item in sampling])
        return {item.seq.seq_id: token for (_, item), token in zip(sampling, tokens)}


def _last_rows(items: list[ScheduledSequence]) -> list[int]:
    rows, end = [], 0
    for item in items:
        end += item.num_new_tokens
        rows.append(end - 1)
    return rows
