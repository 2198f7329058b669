"""Names of full KV pages, for prefix caching. Torch-free: the simulator names pages the same way.

A full page is named by SHA-256 over its parent's name and its token ids; the first page's parent is the root,
which carries the request's cache salt:

    root = H(tag, salt)      page 0 = H(root, tokens 0..15)      page 1 = H(page 0, tokens 16..31)   ...

so two requests share page k exactly when they share the salt and every token up to the end of page k. Not
Python's `hash`: 64 bits, seeded per process; a collision would hand one request another's KV. Even so a hit is
confirmed against the page's stored token ids (`page_key`) before it is used.
"""
from __future__ import annotations

import hashlib
from array import array

ROOT_TAG = b"kvplan-prefix-cache-v1"


def root_hash(cache_salt: str | None) -> bytes:
    """The parent of a request's first page: requests with different salts never share a page."""
    salt = b"" if cache_salt is None else b"\x01" + cache_salt.encode()
    return hashlib.sha256(ROOT_TAG + salt).digest()


def page_key(token_ids: list[int]) -> bytes:
    """A page's token ids as bytes (int32): what is hashed, and what a hit is confirmed against."""
    return array("i", token_ids).tobytes()


def chain_hash(parent: bytes, key: bytes) -> bytes:
    return hashlib.sha256(parent + key).digest()


def validate_cache_salt(cache_salt: object) -> str | None:
    """A salt is a non-empty string (or None: no salt); returns it, or raises ValueError naming it."""
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
    return cache_salt
