"""Bytes arriving -> tensors patched: reconstruct a verified target from a verified base and cached deltas
(``reconstruct``), patch a checkpoint in place (``patcher``, ``applier``), apply buckets as they arrive
(``pipeline``).

The top room of ``storage``: may import every other one.
"""
