"""The chaos soak at test size: a live `engine serve` process under a few hundred requests of a hostile mix
(bench/soak.py runs the full 2,000)."""
from __future__ import annotations

from engine.server.soak import SoakConfig, run_soak
from engine.server.soak_verdict import table

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


def test_a_differing_token_is_forgiven_only_at_a_near_tie(monkeypatch, engine):
    """`Soak.near_tie` scores the prompt (completion or chat template) and the reference up to the first differing
    token: that token and the reference's within TIE_LOGIT_GAP in logit is a near-tie; the same tokens, or a
    difference beyond the gap, are not."""
    import engine.server.soak as soak_module
    from engine.core.sequence import SamplingParams
    from engine.server.soak import Planned, Soak

    class Unstarted:
        url = "http://127.0.0.1:9"          # the clients are made, never used

    soak = Soak(SMALL, Unstarted())
    for chat in (False, True):
        item = Planned(0, "good", chat, 1, 8, False)
        prompt = soak.prompts[1]
        if chat:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        reference = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
        other = reference[:3] + [(reference[3] + 1) % 49152] + reference[4:]
        assert not soak.near_tie(item, reference, reference)
        monkeypatch.setattr(soak_module, "TIE_LOGIT_GAP", 0.0)
        assert not soak.near_tie(item, other, reference)
        monkeypatch.setattr(soak_module, "TIE_LOGIT_GAP", 1e9)
        assert soak.near_tie(item, other, reference)
