"""Logging set up once for the whole package, level from VLLM_LOGGING_LEVEL."""

from __future__ import annotations

import logging
import sys
from typing import Any

_ROOT = "cpullm"
_configured = False


def init_logger(name: str) -> logging.Logger:
    """Return a logger under the package root, configuring the root on first use."""
    global _configured
    if not _configured:
        from cpullm import envs

        root = logging.getLogger(_ROOT)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
                              datefmt="%m-%d %H:%M:%S")
        )
        root.addHandler(handler)
        root.setLevel(envs.VLLM_LOGGING_LEVEL.upper())
        root.propagate = False
        _configured = True
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")


def set_log_level(level: int) -> None:
    """The level of every cpullm logger from now on (``cpullm chat``: warnings only)."""
    init_logger(_ROOT)
    logging.getLogger(_ROOT).setLevel(level)


def logging_to_tqdm() -> Any:
    """A context in which cpullm's log lines go through tqdm's writer, so that a line logged
    while a progress bar is up lands above the bar instead of on its line."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm(loggers=[logging.getLogger(_ROOT)])
