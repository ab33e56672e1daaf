"""Bytes and their rules (docs/format.md, sections 3 and 5): safetensors headers, zstd frames, the delta
encodings and their codecs, checksums and digests, a local checkpoint's tensor table, tensors in memory.

Imports only the cross-cutting modules of ``storage``: nothing here knows about object storage, the
catalog or the node's store.
"""
