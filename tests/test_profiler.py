"""The profiler on the real engine: what a profile records, and re-timing its own points later."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.core.step_shape import PROFILE_VERSION, SAMPLE_KINDS
from engine.harness.profiler import MAX_TIMINGS_PER_PASS, SECONDS_PER_POINT_PER_PASS, Profiler, SweepPlan
from engine.llm import LLM


@pytest.fixture(scope="module")
def small_engine() -> Iterator[LLM]:
    with LLM(model="smollm2-135m", weights="fp32", kv_dtype="bf16", device="cpu", num_pages=40, page_size=16,
             max_num_seqs=8, max_num_batched_tokens=256, integrity="off") as llm:
        yield llm


@pytest.fixture(scope="module")
def profile(small_engine) -> dict:
    plan = SweepPlan(prefill_tokens=(16, 48, 4096), multi_prefills=((40, 3), (600, 4)), decode_batches=(1, 3),
                     decode_contexts=(40, 9000), mixed=((2, 40, 24), (64, 40, 24), (1, 40, 31, 2)),
                     prefix_prefills=((24, 200), (300, 100), (64, 900)), warmup=0, repeats=2)
    return Profiler(small_engine, plan).run()


def test_a_profile_records_its_points_and_how_attention_reads(profile, small_engine):
    assert profile["version"] == PROFILE_VERSION
    kinds = [s["kind"] for s in profile["samples"]]
    # the 4096-token prefill, 600 tokens in one step, the 9000-token contexts, 64 decodes, a 300-token chunk and
    # 900 cached tokens do not fit this engine: left out
    assert kinds == ["prefill", "prefill", "prefill", "decode", "decode", "mixed", "mixed", "prefix"]
    assert set(kinds) == set(SAMPLE_KINDS) - {"verify"}
    # 24 new tokens over 200 cached: each reads the prefix and the chunk up to itself
    (prefix,) = [s for s in profile["samples"] if s["kind"] == "prefix"]
    assert prefix["batch"] | {"num_prefills": 1, "prefill_tokens": 24, "prefill_context_tokens": 224,
                              "prefill_pairs": 24 * 200 + 24 * 25 // 2, "num_decodes": 0} == prefix["batch"]
    assert Profiler.point_of(prefix) == (24, 200)
    # several prompts prefilled in one step, as even as integers allow, alone or beside decodes
    shapes = [(s["batch"]["num_prefills"], s["batch"]["prefill_tokens"], s["batch"]["prefill_pairs"])
              for s in profile["samples"] if s["batch"]["num_prefills"] and s["kind"] != "prefix"]
    def pairs(*prompts: int) -> int:
        return sum(n * (n + 1) // 2 for n in prompts)
    assert shapes == [(1, 16, pairs(16)), (1, 48, pairs(48)), (3, 40, pairs(14, 13, 13)), (1, 24, pairs(24)),
                      (2, 31, pairs(16, 15))]
    decodes = [s["batch"] for s in profile["samples"] if s["kind"] == "decode"]
    assert [(b["num_decodes"], b["decode_context_tokens"], b["decode_max_context"]) for b in decodes] == \
        [(1, 40, 40), (3, 120, 40)]
    assert profile["model"]["decode_padding_page"] == small_engine.config.page_size     # torch decode on a CPU
    assert all(s["median_s"] > 0 and s["achieved_gb_s"] > 0 for s in profile["samples"])
    # seeded decodes read real K/V (a prefill's, tiled over the pool), not never-written zeros
    for pool in (small_engine.core.kv_cache.keys, small_engine.core.kv_cache.values):
        assert bool((pool.float().flatten(2).abs().amax(-1) > 0).all())


def test_a_profile_times_the_linear_layers_by_row_count(profile):
    """Rows 1..8 each, then a grid up to the first count at or past the largest step (48 prefill tokens;
    3 sequences for the head); a time for every count."""
    linears = profile["linears"]
    assert linears["rows"] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48]
    assert linears["head_rows"] == [1, 2, 3]
    assert len(linears["decoder_s"]) == len(linears["rows"]) and len(linears["head_s"]) == len(linears["head_rows"])
    assert all(t > 0 for t in linears["decoder_s"] + linears["head_s"])
    # 48 rows of all 30 layers' matmuls cost more than one row (the weights are read either way)
    assert linears["decoder_s"][-1] > linears["decoder_s"][0]


def test_the_profile_points_can_be_timed_again(profile, small_engine):
    """`planner verify` re-times a few profile points to see how the machine's speed drifted."""
    profiler = Profiler(small_engine, SweepPlan(warmup=0, repeats=1))
    for sample in profile["samples"]:
        assert profiler.can_remeasure(sample)
        again = profiler.remeasure(sample)
        assert again["kind"] == sample["kind"] and again["batch"] == sample["batch"] and again["median_s"] > 0
    assert small_engine.core.block_manager.num_used_pages == 0 and not small_engine.has_unfinished()
    too_big = {"kind": "decode", "batch": {"num_decodes": 8, "decode_context_tokens": 8 * 200}}
    assert not profiler.can_remeasure(too_big)      # 8 x 200 tokens > 40 pages of 16


@pytest.mark.timed      # a point is cheap by its first timing: on a busy machine none may be (seen 2026-12-04)
def test_cheap_points_are_timed_more_often_in_later_passes(profile):
    """Once in the first pass; in the second as often as the first timing says fits the time per point."""
    def allowed(first: float) -> set[int]:      # times are rounded to the microsecond: either side of a boundary
        return {1 + max(1, min(MAX_TIMINGS_PER_PASS, int(SECONDS_PER_POINT_PER_PASS / (first * (1 + d)))))
                for d in (-1e-4, 0.0, 1e-4)}
    for sample in profile["samples"]:
        assert len(sample["times_s"]) in allowed(sample["times_s"][0]), sample
    assert any(len(sample["times_s"]) > 2 for sample in profile["samples"])


def test_a_speculative_engine_is_also_timed_verifying_drafts():
    """With ngram:3, verification points at each decode batch and the shortest and longest context that fit: every
    sequence of the step checks 3 drafts (4-token chunks); the other points run without drafts, and the engine's
    own proposer is back afterwards. A profile's verification is timed again only by an engine drafting as many."""
    llm = LLM(model="smollm2-135m", weights="fp32", kv_dtype="bf16", device="cpu", num_pages=60, page_size=16,
              max_num_seqs=8, max_num_batched_tokens=256, integrity="off", speculative="ngram:3")
    proposer = llm.core.proposer
    plan = SweepPlan(prefill_tokens=(16,), multi_prefills=(), decode_batches=(1, 3), decode_contexts=(40, 100, 9000),
                     mixed=((2, 40, 24),), warmup=0, repeats=1)
    profile = Profiler(llm, plan).run()
    kinds = [s["kind"] for s in profile["samples"]]
    assert kinds == ["prefill", "decode", "decode", "decode", "decode", "mixed", "verify", "verify"]
    verify = [s for s in profile["samples"] if s["kind"] == "verify"]
    assert [Profiler.point_of(s) for s in verify] == [(1, 40), (3, 40)]      # 9000 does not fit
    assert verify[1]["batch"] | {"num_verifications": 3, "verification_tokens": 12, "num_decodes": 0,
                                 "prefill_context_tokens": 3 * 43} == verify[1]["batch"]
    assert all("num_verifications" not in s["batch"] for s in profile["samples"] if s["kind"] != "verify")
    assert llm.core.proposer is proposer and llm.core.block_manager.num_used_pages == 0
    profiler = Profiler(llm, SweepPlan(warmup=0, repeats=1))
    assert profiler.can_remeasure(verify[1]) and profiler.remeasure(verify[1])["batch"] == verify[1]["batch"]
    two_drafts = LLM(model="smollm2-135m", weights="fp32", device="cpu", num_pages=60, speculative="ngram:2")
    assert not Profiler(two_drafts, SweepPlan(warmup=0, repeats=1)).can_remeasure(verify[1])


def test_a_calibration_reports_its_error_on_prefills_over_a_cached_prefix(profile):
    """The fit reads a prefix sample as any other step (its cached tokens are attention context) and reports its
    error apart, as it does each regime's."""
    from planner.calibration.profile_fit import calibrate

    document = calibrate(profile, max_mape=1e6)
    assert {"mape_prefill_pct", "mape_decode_pct", "mape_mixed_pct", "mape_prefix_pct"} <= set(document)
    assert document["mape_prefix_pct"] >= 0
