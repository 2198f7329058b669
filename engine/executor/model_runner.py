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
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.core.memory import pages_for_tokens
from engine.core.spec import ModelSpec
from engine.executor.integrity import StepCheck
from engine.executor.step_plan import StepPlan
from engine.kernels.backend import use_triton
from engine.model.architectures.base import DecoderModel
from engine.model.attention import AttentionMetadata, PrefillChunk, chunk_causal_mask, decode_mask
from engine.model.kv_cache import PagedKVCache

FIRST_GRAPH_SIZES = (1, 2, 4, 8)
GRAPH_SIZE_STEP = 8

log = logging.getLogger("engine.executor.model_runner")
# the integrity check of a step on the device (`IntegrityChecker.device_flags`): flags by item, slots redirected
DeviceCheck = Callable[[StepCheck, int], torch.Tensor]


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


def graphs_refused(config: ModelSpec, has_mtp: bool, experts_fused: bool = True) -> str | None:
    """Why a model's decode steps cannot be captured as graphs (None: they can). Routed experts the grouped GEMM
    does not serve (FP8 ones) loop over the experts the step touches, which the host reads back; DSA decides on
    the host whether a step selects; MTP drafting reads the hidden states between passes."""
    if config.ffn.moe_layers and not experts_fused:
        return "routed experts loop over the experts on the host"
    if config.attention.index_topk:
        return "sparse attention decides on the host whether a step selects"
    if has_mtp:
        return "MTP drafting reads hidden states between passes"
    return None


@dataclass(frozen=True)
class StepInputs:
    token_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logit_rows: torch.Tensor | None
    check: StepCheck | None             # the plan asked for the device check


def _padded(rows: list[list[int]], width: int) -> list[int]:
    return [value for row in rows for value in row + [0] * (width - len(row))]


def _check_parts(plan: StepPlan) -> list[list[int]]:
    """What the device check reads, as lists: tables and leases of every item (padded), entry counts, sequence
    ids, each item's first row and row count."""
    tables = plan.tables()
    width = max((len(table) for table in tables), default=0)
    rows = [plan.rows(item) for item in range(plan.num_items)]
    return [_padded(tables, width), _padded(plan.leases, width), [len(table) for table in tables], plan.seq_ids,
            [span.start for span in rows], [len(span) for span in rows]]


def step_inputs(plan: StepPlan, page_size: int, device: torch.device) -> StepInputs:
    """The plan's inputs on the device from one packed host-to-device copy: token ids, positions, slots, decode
    context lengths, decode tables (padded to the longest), each prefill's pages, the logit rows, and what the
    device check reads where the plan asks for it."""
    num_decodes = len(plan.decode_tables)
    width = max((len(t) for t in plan.decode_tables), default=0)
    parts = [plan.token_ids, plan.positions, plan.slots, plan.decode_lens]
    parts += [table + [0] * (width - len(table)) for table in plan.decode_tables]
    parts += [pages for *_, pages in plan.prefills]
    parts.append(plan.logit_rows or [])
    check_parts = _check_parts(plan) if plan.device_check else []
    parts += check_parts
    sizes = [len(part) for part in parts]
    packed = torch.tensor([value for part in parts for value in part], dtype=torch.int64)
    if device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    pieces = list(packed.split(sizes))
    token_ids, positions, slots, context_lens = pieces[:4]
    first_table = sum(sizes[:4])            # the decode tables lie side by side: one [decodes, width] view
    tables = packed[first_table:first_table + num_decodes * width]
    check = None
    if check_parts:
        item_tables, item_leases, counts, seq_ids, row_starts, row_counts = pieces[-6:]
        items = len(seq_ids)
        check_width = len(item_tables) // max(items, 1)
        check = StepCheck(item_tables.view(items, check_width), item_leases.view(items, check_width), counts,
                          seq_ids, row_starts, row_counts, slots)
        pieces = pieces[:-6]
    prefill_pages = pieces[4 + num_decodes:-1]
    metadata = AttentionMetadata(
        slot_mapping=slots, num_decodes=num_decodes,
        decode_block_tables=tables.reshape(num_decodes, width), decode_context_lens=context_lens,
        decode_mask=decode_mask(context_lens, width, page_size),
        prefills=tuple(PrefillChunk(row, tokens, context, pages, chunk_causal_mask(tokens, context, device))
                       for (row, tokens, context, _), pages in zip(plan.prefills, prefill_pages)))
    return StepInputs(token_ids, positions, metadata, None if plan.logit_rows is None else pieces[-1], check)


@torch.inference_mode()
def forward_plan(model: DecoderModel, kv_cache: PagedKVCache, plan: StepPlan, page_size: int,
                 device: torch.device) -> torch.Tensor | None:
    """The plan's forward pass on this rank's shard, eagerly: float32 logits [rows, vocab] of the plan's logit
    rows (every row when it names none), or None when it wants no logits."""
    if not plan.token_ids:
        return None
    return run_inputs(model, kv_cache, plan, step_inputs(plan, page_size, device))


@torch.inference_mode()
def run_inputs(model: DecoderModel, kv_cache: PagedKVCache, plan: StepPlan, inputs: StepInputs) -> torch.Tensor | None:
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
    block tables [max batch, pages of the longest context] (and, for the device check, sequence ids, table lengths
    and leases). A step of B decodes runs as the smallest captured size G >= B: its inputs packed on the host,
    copied in once, spread into the buffers by device copies; rows B..G-1 are padding that reads and writes only
    `pad_page`, a page of the pool the block manager never hands out.

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
        self.staging = torch.zeros(6 * rows + 2 * rows * self.width, dtype=torch.int64, device=device)
        self.host = torch.zeros(self.staging.shape, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._host_values = self.host.numpy()
        self.token_ids, self.positions, self.slots, self.context_lens, self.seq_ids, self.table_lengths = (
            torch.zeros(rows, dtype=torch.int64, device=device) for _ in range(6))
        self.tables = torch.full((rows, self.width), pad_page, dtype=torch.int64, device=device)
        self.leases = torch.zeros((rows, self.width), dtype=torch.int64, device=device)
        self.row_starts = torch.arange(rows, dtype=torch.int64, device=device)
        self.row_counts = torch.ones(rows, dtype=torch.int64, device=device)
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
        """Captures every size, largest first (the smaller ones reuse its memory pool); times and sizes them.
        RuntimeError if a size cannot be captured (the caller runs eagerly then)."""
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
    def run(self, plan: StepPlan, device_check: DeviceCheck | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Float32 logits [B, vocab] of a plan that `fits`; with `device_check` (and a plan that asks for it), the
        flags of its B items, checked before the replay."""
        count = len(plan.decode_tables)
        size = self.sizes[bisect.bisect_left(self.sizes, count)]
        width = max(len(table) for table in plan.decode_tables)
        pad_slot = self.pad_page * self.page_size
        checked = plan.device_check and device_check is not None
        values = self._host_values
        columns = (plan.token_ids, plan.positions, plan.slots, plan.decode_lens, plan.seq_ids,
                   [len(table) for table in plan.decode_tables] if checked else [])
        for index, (column, fill) in enumerate(zip(columns, (0, 0, pad_slot, 1, -1, 0))):
            start = index * size
            values[start:start + len(column)] = column
            values[start + len(column):start + size] = fill
        tables = values[6 * size:6 * size + size * width].reshape(size, width)
        tables[:] = self.pad_page
        for row, table in enumerate(plan.decode_tables):
            tables[row, :len(table)] = table
        used = 6 * size + size * width
        if checked:
            leases = values[used:used + size * width].reshape(size, width)
            for row, table_leases in enumerate(plan.leases):
                leases[row, :len(table_leases)] = table_leases
            used += size * width
        self.staging[:used].copy_(self.host[:used], non_blocking=True)
        staged = self.staging[:used]
        buffers = (self.token_ids, self.positions, self.slots, self.context_lens, self.seq_ids, self.table_lengths)
        for index, buffer in enumerate(buffers[:6 if checked else 4]):
            buffer[:size].copy_(staged[index * size:(index + 1) * size])
        self.tables[:size, :width].copy_(staged[6 * size:6 * size + size * width].view(size, width))
        flags = None
        if checked:
            self.leases[:count, :width].copy_(staged[6 * size + size * width:].view(size, width)[:count])
            flags = device_check(StepCheck(self.tables[:count], self.leases[:count], self.table_lengths[:count],
                                           self.seq_ids[:count], self.row_starts[:count], self.row_counts[:count],
                                           self.slots), pad_slot)
        self.replays += 1
        if self.capture:
            self._graphs[size].replay()
            logits = self._outputs[size]
        else:
            logits = self._forward(size)
        return logits[:count], flags


class ModelRunner:
    """A rank's model and its share of the KV pool, and the forward pass of a plan over them: decode-only plans
    through `graphs` when it holds them, the rest eagerly."""

    def __init__(self, model: DecoderModel, kv_cache: PagedKVCache, page_size: int,
                 graphs: DecodeGraphs | None = None, pad_page: int | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.device = kv_cache.device
        self.graphs = graphs
        self.pad_page = pad_page
        self.device_check: DeviceCheck | None = None        # set by the engine where integrity runs on the device

    def forward(self, plan: StepPlan) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Float32 logits of the plan's logit rows (or None), and where the plan asks for the device check the
        flags of its items (a flagged item's writes went to the padding page)."""
        if self.graphs is not None and self.graphs.fits(plan):
            return self.graphs.run(plan, self.device_check)
        if not plan.token_ids:
            return None, None
        inputs = step_inputs(plan, self.page_size, self.device)
        flags = None
        if inputs.check is not None and self.device_check is not None:
            flags = self.device_check(inputs.check, self.pad_page * self.page_size)
        return run_inputs(self.model, self.kv_cache, plan, inputs), flags

    def attention_metadata(self, plan: StepPlan) -> AttentionMetadata:
        return attention_metadata(plan, self.page_size, self.device)
