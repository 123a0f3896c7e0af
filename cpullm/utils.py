"""Small helpers with no better home; nothing here imports torch."""

from __future__ import annotations

import ctypes
import json
import signal
import sys
from typing import Any


def json_object(value: str | dict[str, Any], what: str) -> dict[str, Any]:
    """A user's JSON object, given as text or as a dict; ValueError naming ``what``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what}: not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what}: expected a JSON object")
    return value


def cdiv(a: int, b: int) -> int:
    """a / b rounded up, for positive b: the blocks that hold a tokens."""
    return -(-a // b)


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (SIGKILL'd servers included)."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
