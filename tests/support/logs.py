"""Counting what a logger emits, once per emit, whatever handlers other tests left on the loggers above it."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def emitted(name: str, level: int = logging.DEBUG) -> Iterator[list[logging.LogRecord]]:
    """The records logger ``name`` emits at ``level`` or above while the block runs (a handler on that logger
    itself: each emit is seen once, even where a handler was also attached to a parent by an earlier set-up)."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger, handler = logging.getLogger(name), Collect(level)
    before = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)
