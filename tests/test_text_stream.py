"""Incremental detokenization: pieces safe to send, incomplete characters and stop strings held back."""
from __future__ import annotations

import pytest

from engine.server.text_stream import TextStream


def byte_tokens(*pieces: bytes):
    """A byte-level vocabulary: token i is pieces[i]; decoding joins the bytes as a BPE tokenizer does."""
    return lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")


def feed(stream: TextStream, count: int, final_at: int | None = None) -> list[str]:
    return [stream.update(list(range(n)), final=n == final_at) for n in range(1, count + 1)]


def test_pieces_add_up_to_the_text():
    decode = byte_tokens(b"Hello", b",", b" world", b"!")
    stream = TextStream(decode)
    assert feed(stream, 4, final_at=4) == ["Hello", ",", " world", "!"]
    assert stream.sent == "Hello, world!" and not stream.stopped


def test_an_incomplete_character_waits_for_its_last_byte():
    decode = byte_tokens(b"caf", b"\xc3", b"\xa9", b" au lait")       # e-acute split over two tokens
    stream = TextStream(decode)
    assert feed(stream, 4) == ["caf", "", "\u00e9", " au lait"]


def test_stop_string_across_tokens_cuts_before_it():
    decode = byte_tokens(b"Hel", b"lo\n", b"\nBye", b" now")
    stream = TextStream(decode, stop=("\n\n",))
    assert feed(stream, 4) == ["Hel", "lo", "", ""]        # "\n" held back: it may begin the stop string
    assert stream.stopped and stream.sent == "Hello"


def test_a_held_tail_is_released_when_it_is_not_a_stop_or_at_the_end():
    decode = byte_tokens(b"a\n", b"b", b"\n")
    stream = TextStream(decode, stop=("\n\n", "STOP"))
    assert feed(stream, 3, final_at=3) == ["a", "\nb", "\n"]
    assert not stream.stopped and stream.sent == "a\nb\n"


def test_the_earliest_of_several_stop_strings_wins():
    decode = byte_tokens(b"one two three four")
    stream = TextStream(decode, stop=("four", "two"))
    assert stream.update([0]) == "one " and stream.stopped


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="stop string"):
        TextStream(byte_tokens(b"x"), stop=("",))
