"""What lives in object storage beside the payloads: revision records and sequence claims (``records``),
index manifests (``manifests``), the publisher that writes them (``publisher``), the records' optional
Ed25519 signatures (``signing``) and the nodes' status records (``nodes``).

Imports ``storage.objects``, ``storage.format`` and the cross-cutting modules; nothing of the node's store.
"""
