"""Small helpers with no better home; nothing here imports torch."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """a / b rounded up, for positive b: the blocks that hold a tokens."""
    return -(-a // b)
