"""Object storage through fsspec: the one place that knows about protocols (``store``), ranged and
resumable downloads (``transfer``), concurrent multipart uploads (``multipart``), and how fsspec, s3fs,
botocore and aiohttp errors map onto ours (``classify``).

Imports the cross-cutting modules and ``storage.format``; nothing of the catalog or the node's store.
"""


def __getattr__(name: str):
    if name == "ObjectStore":  # ``from storage.objects import ObjectStore``, the form earlier docs gave
        from storage.objects.store import ObjectStore

        return ObjectStore
    raise AttributeError(name)
