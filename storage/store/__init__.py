"""The node's local checkpoint store (docs/format.md, section 7): the state machine (``local_store``), its
records, locks, quota, background flush, the artifact cache and the launch snapshot's non-weight files.

Imports ``storage.format`` and the cross-cutting modules; nothing of object storage or the catalog.
"""
