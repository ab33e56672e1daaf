"""The Python API for RL frameworks: publish a revision, refit a node, ask what the nodes run, wait for them.

    from flows import api

    revision = api.publish("/ckpt/step-42", catalog=CATALOG, model="org/name")     # trainer side
    result = api.refit(catalog=CATALOG, model="org/name", seed_checkpoint="/models/launch")  # a node
    api.wait_for(revision.version, catalog=CATALOG, model="org/name", nodes=8, timeout_s=300)

Everything here runs the same runbooks as the command lines and the
deployments. Inside a Prefect flow run their stages are tasks of that run;
outside one (a trainer process) they run without Prefect and need no server
(events are emitted only where a Prefect API is configured). Failures raise
the project's typed errors (``storage.errors``); settings not passed as
arguments come from the same ``CANONICAL_REFIT_*`` environment variables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from flows.fleet import FleetView, WaitOutcome, fleet_status, wait_for
from flows.report import READY, SKIPPED, RefitResult
from storage.catalog import Catalog, Revision
from storage.errors import RefitError
from storage.local_store import LocalStore
from storage.objects import ObjectStore
from storage.settings import InstallerSettings, ObjectStoreSettings, PublishParams, RefitParams

__all__ = ["publish", "refit", "status", "fleet_status", "wait_for", "FleetView", "WaitOutcome", "RefitResult",
           "Revision"]


def _nested(values: dict, name: str, model: type, given) -> None:
    """``values[name]`` from an object, a dict or nothing (the environment then fills it in)."""
    if isinstance(given, dict):
        values[name] = model(**given)
    elif given is not None:
        values[name] = given


def publish(checkpoint: str | Path, *, catalog: str, model: str, kind: str = "delta", version: str | None = None,
            storage: ObjectStoreSettings | Mapping[str, Any] | None = None, **settings) -> Revision:
    """Publish the safetensors checkpoint folder ``checkpoint`` as a new revision; returns its catalog record.

    ``kind`` is ``initial`` (revision 0, an empty catalog only), ``full`` or
    ``delta`` (against the latest revision, from the publisher's kept copy);
    any other ``PublishParams`` field may be passed by name.
    """
    from flows.publish import run_publish

    values: dict = dict(catalog=catalog, model=model, checkpoint=checkpoint, kind=kind, version=version, **settings)
    values = {k: v for k, v in values.items() if v is not None}
    _nested(values, "storage", ObjectStoreSettings, storage)
    params = PublishParams(**values)
    result = run_publish(params)
    return Catalog(ObjectStore(params.storage), params.catalog, params.model).read(result.version)


def refit(*, catalog: str, model: str, target: str = "latest", cache_dir: str | Path | None = None,
          seed_checkpoint: str | Path | None = None,
          installer: InstallerSettings | Mapping[str, Any] | Any | None = None,
          storage: ObjectStoreSettings | Mapping[str, Any] | None = None, check: bool = True,
          **settings) -> RefitResult:
    """Move this node's checkpoint to ``target`` and install it; returns the ``RefitResult`` the CLI prints.

    ``installer`` is an ``InstallerSettings`` (or its dict), or an installer
    object of your own (anything with ``name``, ``install`` and ``is_current``).
    With ``check`` (the default), a run that did not end READY or SKIPPED
    raises its typed error, the result attached as ``error.result``.
    """
    from flows.refit import refit as refit_flow
    from flows.refit import run_refit
    from flows.report import result_of
    from tasks.stage import in_flow_run

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
        result = result_of(refit_flow(params, return_state=True))  # a subflow of the caller's flow run
    else:
        result = run_refit(params, installer=engine)
    if check and result.status not in (READY, SKIPPED):
        error = result.exception if isinstance(result.exception, RefitError) else RefitError(
            result.error or result.status)
        error.result = result
        raise error
    return result


def status(*, model: str, cache_dir: str | Path | None = None) -> dict:
    """This node's store: its state, installed identity, poisoned mark and verified checkpoints."""
    root = Path(cache_dir) if cache_dir else RefitParams.model_fields["cache_dir"].default
    store = LocalStore(root, model, create=False)
    if not store.exists:
        return {"store": str(store.root), "state": None, "active": None, "poisoned": None, "verified": []}
    return store.describe()
