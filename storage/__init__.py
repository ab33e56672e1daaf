"""Everything below the pipeline: formats, object storage, the catalog, the node's store, the patch engine.

No Prefect here. The rooms, and which way imports go (``tests/system/test_layers.py`` enforces it):

    storage/               cross-cutting: errors, settings, retry, urls, durable, keys
    storage/jsonio/        cross-cutting: canonical JSON and the bounded parser
    storage/runtime/       cross-cutting: stop tokens, the collector pause, kill points
                           (imported by every room; import none of them)
    storage/format/        bytes and their rules: safetensors, zstd frames, delta codecs, digests, checkpoints
    storage/objects/       object storage through fsspec: the store, ranged/resumable transfers, multipart, errors
    storage/catalog/       what lives in object storage: revision records, manifests, the publisher, node records
    storage/store/         the node's local checkpoint store: its state machine, records, locks, quota, flush
    storage/patch/         bytes arriving -> tensors patched: reconstruct, patcher, applier, pipeline

    format -> (cross-cutting)
    objects -> format
    catalog -> objects, format
    store -> format
    patch -> store, catalog, objects, format
"""
