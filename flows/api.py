"""The Python API for RL frameworks: publish a revision, refit a node, ask what the nodes run, wait for them.

    from flows import api

    published = api.publish("/ckpt/step-42", catalog=CATALOG, model="org/name")     # trainer side
    published = api.publish(weights, catalog=CATALOG, model="org/name")  # ... or {name: CPU tensor}
    result = api.refit(catalog=CATALOG, model="org/name", seed_checkpoint="/models/launch")  # a node
    api.wait_for(published.version, catalog=CATALOG, model="org/name", nodes=8, timeout_s=300)  # or VersionFailed

Everything here runs the same runbooks as the command lines and the
deployments. Inside a Prefect flow run their stages are tasks of that run;
outside one (a trainer process) they run without Prefect and need no server
(events are emitted only where a Prefect API is configured). Failures raise
the project's typed errors (``storage.errors``); settings not passed as
arguments come from the same ``CANONICAL_REFIT_*`` environment variables.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from flows.fleet import FleetView, VersionFailed, WaitOutcome, fleet_status, forget, wait_for
from flows.report import RefitResult
from storage.format.status import SUCCEEDED, Status
from storage.errors import RefitError
from storage.settings import InstallerSettings, ObjectStoreSettings, PublishParams, RefitParams

if TYPE_CHECKING:
    from flows.publish import PendingPublish, PublishResult
    from storage.catalog.records import Revision

__all__ = ["publish", "refit", "status", "fleet_status", "wait_for", "forget", "FleetView", "WaitOutcome", "RefitResult",
           "Revision", "Status", "VersionFailed"]


def __getattr__(name: str):
    """``Revision``, imported on first use: ``import flows.api`` leaves the catalog stack (object storage,
    codecs) to the calls that read or write a catalog (PEP 562)."""
    if name == "Revision":
        from storage.catalog.records import Revision

        return Revision
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _nested(values: dict, name: str, model: type, given) -> None:
    """``values[name]`` from an object, a dict or nothing (the environment then fills it in)."""
    if isinstance(given, dict):
        values[name] = model(**given)
    elif given is not None:
        values[name] = given


Tensors = Mapping[str, Any] | Iterable[tuple[str, Any]]  # NumPy arrays or torch tensors, on the CPU


def publish(checkpoint: str | Path | Tensors, *, catalog: str, model: str, kind: str = "delta",
            version: str | None = None, keep_base: str = "disk",
            storage: ObjectStoreSettings | Mapping[str, Any] | None = None, wait: bool = True,
            **settings) -> PublishResult | PendingPublish:
    """Publish a checkpoint as a new revision; returns the ``PublishResult`` the CLI prints (``version``,
    ``sequence``, ``record_url``, bytes written, ``seconds``, ``bytes_per_s`` of model bytes, ...).

    ``checkpoint`` is a safetensors checkpoint folder, or the tensors
    themselves: a mapping of names to CPU tensors (NumPy arrays or torch
    tensors, bf16 included) or an iterator of ``(name, tensor)`` pairs. From
    memory, no checkpoint is written to disk; the objects and the record are
    the bytes a folder holding the same tensors in one ``model.safetensors``
    would give (``storage.format.tensor_source``). Tensors are read, never copied,
    so leave them alone until this returns.

    ``kind`` is ``initial`` (revision 0, an empty catalog only), ``full`` or
    ``delta`` (against the latest revision, from the publisher's kept copy).
    ``keep_base`` is where that copy lives: ``disk`` (``state_dir``) or
    ``memory`` (this process: a copy of the tensors, no disk writes). Any
    other ``PublishParams`` field may be passed by name.

    ``wait=False`` returns a ``PendingPublish`` as soon as the checkpoint was
    read (planned, encoded, the next base copied): the trainer may change its
    tensors and train on while the payload uploads and the record is written
    in a thread; ``handle.result()`` gives the ``PublishResult`` or raises the
    error that ended it. The next publication of the same catalog and model
    in this process waits for it first. With ``keep_base="memory"`` the
    process then holds two copies of the model (the base, and the one
    waiting for its record).
    """
    from flows.publish import run_publish, start_publish
    from storage.format.tensor_source import memory_checkpoint

    in_memory = not isinstance(checkpoint, (str, os.PathLike))
    values: dict = dict(catalog=catalog, model=model, kind=kind, version=version, **settings,
                        checkpoint="<memory>" if in_memory else checkpoint)  # the tensors replace the folder
    values = {k: v for k, v in values.items() if v is not None}
    _nested(values, "storage", ObjectStoreSettings, storage)
    params = PublishParams(**values)
    source = None
    if in_memory:
        try:
            source = memory_checkpoint(checkpoint, revision=version)
        except RefitError as exc:
            raise exc.with_context(revision=version or _next_version(params)) from None
    if wait:  # errors name the fields, as the keywords here do (only the CLI renders them as flags)
        return run_publish(params, source=source, keep_base=keep_base)
    return start_publish(params, source=source, keep_base=keep_base)


def _next_version(params: PublishParams) -> str | None:
    """The version a publication without one would get (to name it in an error), if the catalog says."""
    from storage.catalog.records import Catalog
    from storage.objects.store import ObjectStore
    from storage.catalog.publisher import next_sequence

    try:
        return f"r{next_sequence(Catalog(ObjectStore.shared(params.storage), params.catalog, params.model))[0]}"
    except RefitError:
        return None


def refit(*, catalog: str, model: str, target: str = "latest", cache_dir: str | Path | None = None,
          seed_checkpoint: str | Path | None = None,
          installer: InstallerSettings | Mapping[str, Any] | Any | None = None,
          storage: ObjectStoreSettings | Mapping[str, Any] | None = None, check: bool = True,
          **settings) -> RefitResult:
    """Move this node's checkpoint to ``target`` and install it; returns the ``RefitResult`` the CLI prints.

    ``installer`` is an ``InstallerSettings`` (or its dict), or an installer
    object of your own (anything with ``name``, ``install`` and ``is_current``).
    With ``check`` (the default), a run that did not end READY or SKIPPED
    raises its typed error, the result attached as ``error.result``. ``status``
    is a ``Status`` (a ``StrEnum``: it equals the string ``"READY"``, ...).
    """
    from flows.refit import refit as refit_flow
    from flows.refit import run_refit
    from flows.report import result_of, watching
    from flows.prefect_adapter import in_flow_run

    values: dict = dict(catalog=catalog, model=model, target=target, cache_dir=cache_dir,
                        seed_checkpoint=str(seed_checkpoint) if seed_checkpoint else None, **settings)
    values = {k: v for k, v in values.items() if v is not None}
    _nested(values, "storage", ObjectStoreSettings, storage)
    engine = None
    if isinstance(installer, (InstallerSettings, dict)):
        _nested(values, "installer", InstallerSettings, installer)
    else:
        engine = installer
    params = RefitParams(**values)
    if engine is None and in_flow_run():
        from prefect import tags

        from flows.run_labels import node_tag

        with tags(node_tag(params.node)), watching() as watch:  # labelled with its node, as the agent's runs are
            state = refit_flow(params, return_state=True)  # a subflow of the caller's flow run
        result = result_of(state, watch)
    else:
        from storage.runtime.cancel import signals_stop_the_run

        with signals_stop_the_run():  # a Ctrl-C (a notebook's interrupt) stops this refit only
            result = run_refit(params, installer=engine)
    if check and result.status not in SUCCEEDED:
        error = result.exception if isinstance(result.exception, RefitError) else RefitError(
            result.error or result.status)
        error.result = result
        raise error
    return result


def status(*, model: str, cache_dir: str | Path | None = None) -> dict:
    """This node's store: its state, installed identity, poisoned mark and verified checkpoints."""
    from storage.store.local_store import LocalStore

    root = Path(cache_dir) if cache_dir else RefitParams.model_fields["cache_dir"].default
    store = LocalStore(root, model, create=False)
    if not store.exists:
        return {"store": str(store.root), "state": None, "active": None, "poisoned": None, "verified": []}
    return store.describe()
