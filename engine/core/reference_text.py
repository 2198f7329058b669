"""The fixed real English text every prompt, perplexity window and calibration run is cut from: Python's own
documentation topics (`pydoc_data.topics`, shipped with every Python), so that no download is needed and the
same interpreter gives the same text. Torch-free."""
from __future__ import annotations

import random


def reference_text(topics: slice = slice(None), separator: str = " ") -> str:
    """The topics in sorted order (all, or the slice given), joined."""
    from pydoc_data.topics import topics as every_topic

    return separator.join(every_topic[key] for key in sorted(every_topic)[topics])


def reference_ids(tokenizer, vocab_size: int, count: int, topics: slice = slice(None)) -> list[int]:
    """The text's token ids (at least `count`, where the text is that long); a model without a tokenizer (random
    weights) gets `count` fixed pseudo-random ids of its vocabulary instead."""
    if tokenizer is None:
        rng = random.Random(0)
        return [rng.randrange(3, vocab_size) for _ in range(count)]
    return tokenizer.encode(reference_text(topics))


def cut_prompts(ids: list[int], lengths: list[int], stride: int | None = None) -> list[list[int]]:
    """Prompts of the given lengths cut from `ids`: each at `stride` tokens from the last (one after another
    where None, wrapping to the start when the text runs out); a prompt longer than the text is refused."""
    prompts, cursor = [], 0
    for index, length in enumerate(lengths):
        if length > len(ids):
            raise ValueError(f"a prompt of {length} tokens is longer than the text it is cut from ({len(ids)})")
        start = index * stride if stride is not None else cursor
        if start + length > len(ids):
            start = 0
        prompts.append(ids[start:start + length])
        cursor = start + length
    return prompts
