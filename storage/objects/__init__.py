"""Object storage through fsspec: the one place that knows about protocols (``store``); the local filesystem
it lists and reads without fsspec (``localfiles``); its S3 client
(``s3client``), request stats (``stats``) and conditional-write probe (``conditional``); the connection
budget every data request shares (``budget``); ranged and resumable downloads (``transfer``: their
sources in ``sources``, the partial file and its record in ``partial``, local copies in ``localcopy``);
concurrent multipart uploads (``multipart``); and how fsspec, s3fs, botocore and aiohttp errors map onto
ours (``classify``). Imports run one way, from ``store`` down; none of them imports ``store``.

Imports the cross-cutting modules and ``storage.format``; nothing of the catalog or the node's store.
"""


def __getattr__(name: str):
    if name == "ObjectStore":  # ``from storage.objects import ObjectStore``, the form earlier docs gave
        from storage.objects.store import ObjectStore

        return ObjectStore
    raise AttributeError(name)
