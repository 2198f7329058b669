"""Incremental detokenization for streaming: the text of a growing list of tokens, handed out in pieces that
are safe to send, and cut at the first stop string.

A piece is held back while it could still change: a trailing incomplete UTF-8 character (the tokenizer shows
it as U+FFFD until its last byte arrives) and a tail that may be the start of a stop string:

    stop ["\\n\\n"]    text "Hello\\n"   sends "Hello", holds "\\n"      then "Hello\\n\\nBye": stops, sends nothing more
"""
from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()) -> None:
        if any(not text for text in stop):
            raise ValueError("a stop string must not be empty")
        self._decode = decode
        self.stop = stop
        self.sent = ""              # the text handed out so far
        self.stopped = False        # a stop string matched: nothing more comes

    def update(self, token_ids: list[int], final: bool = False) -> str:
        """The new text that is safe to send now (all of it when `final`: the request ended)."""
        if self.stopped:
            return ""
        text = self._decode(token_ids)
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            end = max(cut, len(self.sent))
        elif final:
            end = len(text)
        else:
            end = len(text.rstrip(REPLACEMENT)) if text.endswith(REPLACEMENT) else len(text)
            end -= self._stop_prefix_tail(text[:end])
        if end <= len(self.sent):
            return ""
        piece = text[len(self.sent):end]
        self.sent += piece
        return piece

    def _first_stop(self, text: str) -> int | None:
        """Where the first stop string begins in the text not yet sent (a match may straddle what was sent)."""
        start = max(0, len(self.sent) - max((len(s) for s in self.stop), default=0))
        found = [index for index in (text.find(s, start) for s in self.stop) if index >= 0]
        return min(found) if found else None

    def _stop_prefix_tail(self, text: str) -> int:
        """The length of the longest tail of `text` that begins some stop string."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
