"""One rank's forward pass over a step plan: the plan's flat inputs and block tables made tensors in one
host-to-device copy, the model run through the rank's share of the paged KV pool.

The plan is plain lists (`engine.executor.step_plan.StepPlan`) so that rank 0 can send it to the other ranks, each
of which runs the same forward pass on it with its own `ModelRunner` (`engine.executor.worker.Worker`).

Decode-only steps of a model that allows it replay CUDA graphs (`DecodeGraphs`): captured at start-up for padded
batch sizes over persistent input buffers, so that a step costs one copy in, a few small device copies and one
replay instead of hundreds of kernel launches from Python. Prefill and mixed steps run eagerly."""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from engine.core.memory import pages_for_tokens
from engine.core.spec import ModelSpec
from engine.executor.step_plan import StepPlan
from engine.kernels.backend import use_triton
from engine.model.architectures.base import DecoderModel
from engine.model.attention import AttentionMetadata, PrefillChunk, chunk_causal_mask, decode_mask
from engine.model.kv_cache import PagedKVCache

FIRST_GRAPH_SIZES = (1, 2, 4, 8)
GRAPH_SIZE_STEP = 8

log = logging.getLogger("engine.executor.model_runner")


def graph_batch_sizes(max_num_seqs: int, cap: int | None = None) -> list[int]:
    """The padded batch sizes decode graphs are captured for: 1, 2, 4, 8, then steps of 8, up to the first that
    holds `max_num_seqs` (or `cap`, if smaller)."""
    limit = max_num_seqs if cap is None else min(max_num_seqs, cap)
    sizes = []
    for size in (*FIRST_GRAPH_SIZES, *range(2 * GRAPH_SIZE_STEP, limit + GRAPH_SIZE_STEP, GRAPH_SIZE_STEP)):
        sizes.append(size)
        if size >= limit:
            break
    return sizes


def graphs_refused(config: ModelSpec, has_mtp: bool) -> str | None:
    """Why a model's decode steps cannot be captured as graphs (None: they can). Routed experts choose their work
    on the host (which tokens go to which expert), MLA and sparse attention are not captured yet, MTP drafting
    reads the hidden states between passes."""
    if config.ffn.moe_layers:
        return "routed experts dispatch on the host"
    if config.attention.kind != "gqa":
        return f"{config.attention.kind} attention is not captured yet"
    if has_mtp:
        return "MTP drafting reads hidden states between passes"
    return None


@dataclass(frozen=True)
class StepInputs:
    token_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logit_rows: torch.Tensor | None


def step_inputs(plan: StepPlan, page_size: int, device: torch.device) -> StepInputs:
    """The plan's inputs on the device from one packed host-to-device copy: token ids, positions, slots, decode
    context lengths, decode tables (padded to the longest), each prefill's pages, the logit rows."""
    num_decodes = len(plan.decode_tables)
    width = max((len(t) for t in plan.decode_tables), default=0)
    parts = [plan.token_ids, plan.positions, plan.slots, plan.decode_lens]
    parts += [table + [0] * (width - len(table)) for table in plan.decode_tables]
    parts += [pages for *_, pages in plan.prefills]
    parts.append(plan.logit_rows or [])
    sizes = [len(part) for part in parts]
    packed = torch.tensor([value for part in parts for value in part], dtype=torch.int64)
    if device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    pieces = list(packed.split(sizes))
    token_ids, positions, slots, context_lens = pieces[:4]
    first_table = sum(sizes[:4])            # the decode tables lie side by side: one [decodes, width] view
    tables = packed[first_table:first_table + num_decodes * width]
    prefill_pages = pieces[4 + num_decodes:-1]
    metadata = AttentionMetadata(
        slot_mapping=slots, num_decodes=num_decodes,
        decode_block_tables=tables.reshape(num_decodes, width), decode_context_lens=context_lens,
        decode_mask=decode_mask(context_lens, width, page_size),
        prefills=tuple(PrefillChunk(row, tokens, context, pages, chunk_causal_mask(tokens, context, device))
                       for (row, tokens, context, _), pages in zip(plan.prefills, prefill_pages)))
    return StepInputs(token_ids, positions, metadata, None if plan.logit_rows is None else pieces[-1])


@torch.inference_mode()
def forward_plan(model: DecoderModel, kv_cache: PagedKVCache, plan: StepPlan, page_size: int,
                 device: torch.device) -> torch.Tensor | None:
    """The plan's forward pass on this rank's shard, eagerly: float32 logits [rows, vocab] of the plan's logit
    rows (every row when it names none), or None when it wants no logits."""
    if not plan.token_ids:
        return None
    inputs = step_inputs(plan, page_size, device)
    kv_cache.calibrating = plan.calibrate_kv
    hidden = model(inputs.token_ids, inputs.positions, kv_cache, inputs.metadata)
    if plan.logit_rows == []:
        return None
    return model.compute_logits(hidden if inputs.logit_rows is None else hidden[inputs.logit_rows])


def attention_metadata(plan: StepPlan, page_size: int, device: torch.device) -> AttentionMetadata:
    """Where the plan's rows write and what each attends: decodes by their block tables, prefill chunks by theirs."""
    return step_inputs(plan, page_size, device).metadata


class DecodeGraphs:
    """Decode-only steps over persistent buffers: token ids, positions, slots and context lengths [max batch] and
    block tables [max batch, pages of the longest context]. A step of B decodes runs as the smallest captured size
    G >= B: its inputs packed on the host, copied in once, spread into the buffers by device copies; rows B..G-1
    are padding that reads and writes only `pad_page`, a page of the pool the block manager never hands out.

    With `capture` (CUDA) each size is a CUDA graph, captured largest first into one memory pool; without it (CPU)
    each size runs the same static-shape forward eagerly, which is what the tests check against the eager path."""

    def __init__(self, model: DecoderModel, kv_cache: PagedKVCache, page_size: int, max_model_len: int,
                 sizes: list[int], pad_page: int, capture: bool) -> None:
        self.model, self.kv_cache, self.page_size = model, kv_cache, page_size
        self.sizes = sorted(sizes)
        self.pad_page = pad_page
        self.capture = capture
        self.max_batch = self.sizes[-1]
        self.width = pages_for_tokens(max_model_len, page_size)
        device = kv_cache.device
        rows = self.max_batch
        self.staging = torch.zeros(4 * rows + rows * self.width, dtype=torch.int64, device=device)
        self.host = torch.zeros(self.staging.shape, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._host_values = self.host.numpy()
        self.token_ids, self.positions, self.slots, self.context_lens = (
            torch.zeros(rows, dtype=torch.int64, device=device) for _ in range(4))
        self.tables = torch.full((rows, self.width), pad_page, dtype=torch.int64, device=device)
        self.context_lens.fill_(1)
        self.slots.fill_(pad_page * page_size)
        self._outputs: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        self.graph_bytes = 0
        self.replays = 0                    # decode steps run through the buffers

    def fits(self, plan: StepPlan) -> bool:
        """A decode-only plan the graphs hold: every row a decode wanting its logits, not calibrating scales."""
        count = len(plan.decode_tables)
        return (not plan.prefills and 0 < count <= self.max_batch and not plan.calibrate_kv
                and (plan.logit_rows is None or plan.logit_rows == list(range(count))))

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Captures every size, largest first (the smaller ones reuse its memory pool); times and sizes them."""
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.kv_cache.device)[0] if self.capture else 0
        pool = None
        for size in reversed(self.sizes):
            if not self.capture:
                continue
            self._forward(size)                 # warm-up: Triton compiles and autotunes outside the capture
            torch.cuda.synchronize(self.kv_cache.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self._forward(size)
            pool = graph.pool()
            self._graphs[size] = graph
        if self.capture:
            torch.cuda.synchronize(self.kv_cache.device)
            self.graph_bytes = free_before - torch.cuda.mem_get_info(self.kv_cache.device)[0]
        self.capture_seconds = time.perf_counter() - started
        log.info("decode graphs: %d sizes (1..%d) captured in %.2f s, %.1f MiB", len(self._graphs), self.max_batch,
                 self.capture_seconds, self.graph_bytes / 2**20)

    def _forward(self, size: int) -> torch.Tensor:
        lens = self.context_lens[:size]
        metadata = AttentionMetadata(
            slot_mapping=self.slots[:size], num_decodes=size, decode_block_tables=self.tables[:size],
            decode_context_lens=lens, prefills=(),
            decode_mask=lens[:0] if use_triton(lens) else decode_mask(lens, self.width, self.page_size))
        hidden = self.model(self.token_ids[:size], self.positions[:size], self.kv_cache, metadata)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """Float32 logits [B, vocab] of a plan that `fits`."""
        count = len(plan.decode_tables)
        size = self.sizes[bisect.bisect_left(self.sizes, count)]
        width = max(len(table) for table in plan.decode_tables)
        pad = size - count
        pad_slot = self.pad_page * self.page_size
        values = self._host_values
        values[0:count] = plan.token_ids
        values[size:size + count] = plan.positions
        values[2 * size:2 * size + count] = plan.slots
        values[3 * size:3 * size + count] = plan.decode_lens
        for start, fill in ((0, 0), (size, 0), (2 * size, pad_slot), (3 * size, 1)):
            values[start + count:start + size] = fill
        tables = values[4 * size:4 * size + size * width].reshape(size, width)
        tables[:] = self.pad_page
        for row, table in enumerate(plan.decode_tables):
            tables[row, :len(table)] = table
        used = 4 * size + size * width
        self.staging[:used].copy_(self.host[:used], non_blocking=True)
        staged = self.staging[:used]
        for buffer, start in ((self.token_ids, 0), (self.positions, size), (self.slots, 2 * size),
                              (self.context_lens, 3 * size)):
            buffer[:size].copy_(staged[start:start + size])
        self.tables[:size, :width].copy_(staged[4 * size:].view(size, width))
        self.replays += 1
        if self.capture:
            self._graphs[size].replay()
            logits = self._outputs[size]
        else:
            logits = self._forward(size)
        return logits[:count] if pad else logits


class ModelRunner:
    """A rank's model and its share of the KV pool, and the forward pass of a plan over them: decode-only plans
    through `graphs` when it holds them, the rest eagerly."""

    def __init__(self, model: DecoderModel, kv_cache: PagedKVCache, page_size: int,
                 graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.device = kv_cache.device
        self.graphs = graphs

    def forward(self, plan: StepPlan) -> torch.Tensor | None:
        """Float32 logits of the plan's logit rows, or None."""
        if self.graphs is not None and self.graphs.fits(plan):
            return self.graphs.run(plan)
        return forward_plan(self.model, self.kv_cache, plan, self.page_size, self.device)

    def attention_metadata(self, plan: StepPlan) -> AttentionMetadata:
        return attention_metadata(plan, self.page_size, self.device)
