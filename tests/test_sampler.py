"""Sampling filters on hand-made logits: exact kept sets, and seeded reproducibility."""
from __future__ import annotations

import math

import pytest
import torch

from engine.core.errors import RequestError
from engine.core.sequence import SamplingParams
from engine.executor.sampler import filter_logits, sample

LOGITS = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))


def kept(params: SamplingParams) -> list[int]:
    return torch.nonzero(filter_logits(LOGITS, params) > -math.inf).flatten().tolist()


def test_top_k_and_top_p_keep_exact_sets():
    assert kept(SamplingParams(temperature=1.0, top_k=2)) == [0, 1]
    assert kept(SamplingParams(temperature=1.0, top_p=0.5)) == [0]
    assert kept(SamplingParams(temperature=1.0, top_p=0.6)) == [0, 1]
    assert kept(SamplingParams(temperature=1.0, top_p=0.86)) == [0, 1, 2, 3]
    assert kept(SamplingParams(temperature=1.0, top_k=3, top_p=0.6)) == [0, 1]


def test_greedy_and_seeded_sampling():
    logits = LOGITS.repeat(3, 1)
    greedy = SamplingParams()
    hot = SamplingParams(temperature=1.0)
    draws = [sample(logits, [greedy, hot, hot], [None, torch.Generator().manual_seed(7),
                                                  torch.Generator().manual_seed(7)]) for _ in range(1)]
    assert draws[0][0] == 0 and draws[0][1] == draws[0][2]
    generator = torch.Generator().manual_seed(1)
    counts = torch.bincount(torch.tensor([sample(LOGITS[None], [hot], [generator])[0] for _ in range(2000)]),
                            minlength=5).float() / 2000
    assert torch.allclose(counts, LOGITS.exp(), atol=0.04)


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(max_tokens=-3), dict(temperature=-1.0),
                                 dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)])
def test_bad_sampling_params_are_rejected(bad):
    with pytest.raises(RequestError):
        SamplingParams(**bad)
