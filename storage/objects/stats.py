"""What a stage's object-storage requests cost: ``TransferStats``, counted by every request of a store view."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field



@dataclass
class TransferStats:
    """Counts requests, retries and backoff of one stage (thread-safe)."""

    attempts: int = 0
    retries: int = 0
    backoff_s: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, *, attempts=0, retries=0, backoff_s=0.0, bytes_read=0, bytes_written=0) -> None:
        with self._lock:
            self.attempts += attempts
            self.retries += retries
            self.backoff_s += backoff_s
            self.bytes_read += bytes_read
            self.bytes_written += bytes_written

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "attempts": self.attempts,
                "retries": self.retries,
                "backoff_s": round(self.backoff_s, 3),
                "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written,
            }


