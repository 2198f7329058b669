"""The chaos soak at test size: a live `engine serve` process under a few hundred requests of a hostile mix
(bench/soak.py runs the full 2,000)."""
from __future__ import annotations

from engine.harness.soak import SoakConfig, run_soak
from engine.harness.soak_verdict import table

SMALL = SoakConfig(requests=256, clients=32, faults=4, prompts=6, max_tokens=(4, 8, 16), last_wave_tokens=16,
                   memory_gib=0.05, bad_share=0.08, seed=3)


def test_a_small_soak_loses_nothing():
    report = run_soak(SMALL)
    counts = report["counts"]
    assert report["failures"] == [], table(report)
    assert counts["requests"] == SMALL.requests
    assert counts["exact"] >= SMALL.requests * 0.7            # most requests were well-formed and checked
    assert counts["hung_up"] > 0 and counts["bad"] == counts["bad_right_status"] > 0
    assert len(report["faults"]) == SMALL.faults and counts["victims"] >= SMALL.faults
    assert report["pages_used_idle"] == 0 and report["pages_quarantined"] > 0    # faults quarantine, nothing leaks
    assert report["shutdown"]["exit_code"] == 0 and report["shutdown"]["probe_statuses"] == [503] * 3
    assert counts["near_ties"] <= SMALL.requests * 0.02         # forgiven only at a genuine greedy near-tie


def greedy(engine, prompt: list[int], max_tokens: int) -> list[int]:
    from engine.core.sequence import SamplingParams

    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids


def test_near_ties_are_judged_token_by_token_at_the_real_threshold(engine):
    """Real close pairs of SmolLM2 on English text, one each side of TIE_LOGIT_GAP (0.0085 and 0.0104 on this
    text): an answer that takes the runner-up of the pair below it and is greedy after is one near-tie; the pair
    above it is no near-tie; a flip at a near-tie followed by a token the model does not choose (a wrong row
    after it, which the first-difference rule forgave) fails. In the verdict, a victim's or a hung-up stream's
    prefix is exact or wrong, and near-ties beyond the bound fail the soak."""
    from engine.core.reference_text import reference_text
    from engine.harness.soak import TIE_LOGIT_GAP, Outcome, Planned, Soak, greedy_up_to_ties
    from engine.harness.soak_verdict import judge

    ids = engine.tokenizer.encode(reference_text(slice(40)))[:512]
    top = engine.score(ids).topk(3, dim=-1)
    gaps = (top.values[:, 0] - top.values[:, 1]).tolist()
    below = max((i for i, gap in enumerate(gaps) if gap < TIE_LOGIT_GAP - 1e-4), key=lambda i: gaps[i])
    above = min((i for i, gap in enumerate(gaps) if gap > TIE_LOGIT_GAP + 1e-4), key=lambda i: gaps[i])
    assert TIE_LOGIT_GAP / 2 < gaps[below] and gaps[above] < 2 * TIE_LOGIT_GAP, (gaps[below], gaps[above])

    def answers(row: int) -> tuple[list[int], list[int], list[int]]:
        prompt = ids[:row + 1]
        reference = greedy(engine, prompt, 8)
        assert reference[0] == int(top.indices[row, 0])          # the pair's winner, scored again alone
        runner_up = int(top.indices[row, 1])
        return prompt, reference, [runner_up] + greedy(engine, prompt + [runner_up], 7)

    prompt, reference, flipped = answers(below)
    assert greedy_up_to_ties(engine, prompt, reference) == 0
    assert greedy_up_to_ties(engine, prompt, flipped) == 1
    scored = engine.score(prompt + flipped[:3])[-1].topk(2)
    assert float(scored.values[0] - scored.values[1]) > TIE_LOGIT_GAP       # a clear choice at the wrong row
    wrong_row = flipped[:3] + [int(scored.indices[1])] + flipped[4:]
    assert greedy_up_to_ties(engine, prompt, wrong_row) is None
    far_prompt, _, far_flipped = answers(above)
    assert greedy_up_to_ties(engine, far_prompt, far_flipped) is None

    class Unstarted:
        url = "http://127.0.0.1:9"          # the clients are made, never used

    soak = Soak(SMALL, Unstarted())
    soak._scorer = engine
    soak.prompts = [engine.tokenizer.decode(prompt)]
    assert engine.encode_prompt(soak.prompts[0]) == prompt
    soak.references[False, 0] = reference
    soak.rss = [(0, 1.0), (8, 1.0)]
    cases = [("ok", reference), ("ok", flipped), ("ok", wrong_row), ("hung_up", flipped[:2]), ("victim", flipped[:2]),
             ("error", flipped[:1])]
    for index, (status, tokens) in enumerate(cases):
        soak.planned[index] = Planned(index, "good", False, 0, len(reference), True)
        error = "integrity_error: aborted" if status == "error" else ""
        soak.outcomes[index] = Outcome("hung_up" if status == "victim" else status, 200, error, tokens)
        if status == "victim":
            soak.victims.add(f"cmpl-{soak.planned[index].request_id}")
    shutdown = {"exit_code": 0, "probe_statuses": [503], "probes_with_retry_after": 1,
                "drain_line": "drained: 1 of 1 requests completed, 0 aborted, 0 KV pages in use"}
    report = judge(soak, {"kvplan_kv_pages_used": 0, "kvplan_kv_pages_quarantined": 0}, shutdown)
    counts = report["counts"]
    assert (counts["exact"], counts["near_ties"], counts["corrupted"]) == (1, 1, 1)
    assert (counts["hung_up"], counts["hung_up_prefix_ok"], counts["victims"], counts["victims_prefix_ok"]) == (
        1, 0, 1, 0)
    assert {"1 requests corrupted", "1 of 3 complete answers differ at near-ties (bound 2%)",
            "a cut-off stream received tokens that are not its greedy prefix", "1 requests lost",
            "1 requests harmed"} <= set(report["failures"])
    report["seconds"] = {"references": 0.0}
    assert f"cmpl-{soak.planned[5].request_id}: error 200 integrity_error: aborted" in table(report)   # who, told what
