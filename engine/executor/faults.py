"""The worker side of fault injection: `strike`, which a worker rank applies to its own state when rank 0 sends a
fault with a plan (`engine.executor.step_plan.WorkerFault`): its record of page owners (use_after_free, double_allocation), its copy of
the plan's tables (foreign_page, page_out_of_range), its shard of the KV pool (bit_flip) or its scales
(fp8_scale). Choosing the faults and running the campaign is `engine.harness.fault_campaign`.
"""
from __future__ import annotations

import random

import torch

from engine.executor.integrity import FREE, PageRecord
from engine.executor.step_plan import StepPlan, WorkerFault
from engine.model.kv_cache import PagedKVCache


def strike(fault: WorkerFault, plan: StepPlan, record: PageRecord, kv_cache: PagedKVCache) -> bool:
    """Applies `fault` to a worker's record, plan, pool or scales; False while its victim is not in the plan."""
    rng = random.Random(fault.value)
    if fault.kind in ("use_after_free", "double_allocation"):
        owner = FREE if fault.kind == "use_after_free" else fault.value
        record.apply([(fault.page, owner, int(record.epochs[fault.page]) + 1, -1, (), (), True)])
    elif fault.kind in ("foreign_page", "page_out_of_range"):
        if fault.seq_id not in plan.seq_ids:
            return False
        table = plan.tables()[plan.seq_ids.index(fault.seq_id)]
        if fault.page not in table:
            return False
        table[table.index(fault.page)] = fault.value
    elif fault.kind == "bit_flip":
        pool = rng.choice(kv_cache.pools)
        page_bytes = pool.view(torch.uint8)[rng.randrange(pool.shape[0]), fault.page].view(-1)
        page_bytes[rng.randrange(page_bytes.numel())] ^= 1 << rng.randrange(8)
    else:
        scales = kv_cache.scales[0]
        scales[rng.randrange(scales.shape[0]), rng.randrange(scales.shape[1])] *= 2.0
    return True
