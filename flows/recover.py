"""Recovery of a poisoned node: re-install a verified checkpoint through the installer it was poisoned with.

``python -m flows.refit recover --model M --cache-dir D`` repairs the store
(as every run does) and, if the node is poisoned, re-installs the last
verified checkpoint through the installer and engines recorded in
``poisoned.json``, and clears the mark only once that install succeeded and
was activated. On a healthy node it repairs and says there was nothing to
re-install. Asking for a different installer than the recorded one is
refused unless ``override_installer`` says so explicitly. Where the node's
``catalog`` is given (and its ``node``, default the host name), a recovery
that leaves it healthy rewrites the node's status record at once
(``flows.node_report.refresh_node``): the fleet's ``wait`` and ``status``
stop counting it poisoned without waiting for its agent's next heartbeat.
Errors name the settings' fields (``cache_dir=``); the command line renders
them as its flags.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

from storage.errors import InstallError, StoreError
from storage.format.status import FAILED, POISONED, READY, Status
from storage.store.local_store import LocalStore
from storage.settings import InstallerSettings, RecoverParams
from tasks.installers import make_installer

log = logging.getLogger("canonical_refit.recover")


@dataclass
class RecoverResult:
    """What a recovery did, as ``recover --json`` prints it."""

    status: Status  # READY, FAILED or POISONED
    version: str | None
    installer: str | None = None
    detail: str = ""
    repairs: list[str] = field(default_factory=list)
    error: str | None = None
    node_record: str | None = None  # the node's status record as rewritten (its status), None if not rewritten

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def exit_code(self) -> int:
        return {READY: 0, POISONED: 3}.get(self.status, 1)


def choose_installer(mark, params: RecoverParams, installer=None):
    """The installer to recover through: the recorded one, unless an override was asked for explicitly."""
    if installer is not None:
        given, urls = installer.name, tuple(getattr(installer, "engine_urls", ()) or ())
    elif params.installer is not None:
        given, urls = params.installer.kind, tuple(params.installer.engine_urls)
    else:
        given, urls = None, ()
    recorded = (mark.installer, tuple(mark.engine_urls))
    if given is not None and (given, urls) != recorded and not params.override_installer:
        raise InstallError(
            f"the node was poisoned through installer {mark.installer!r} with engines {list(mark.engine_urls)}; "
            f"recovery re-installs through it. You asked for {given!r} with {list(urls)}: leave out kind= "
            "and engine_urls= to use the recorded one, or add override_installer=True if the engines really moved",
            revision=mark.version, field="installer")
    if installer is not None:
        return installer
    if params.installer is not None:
        return make_installer(params.installer)
    if mark.installer not in ("none", "sglang", "sglang-disk"):
        raise InstallError(f"the node was poisoned through installer {mark.installer!r}, which cannot be rebuilt "
                           "from its name; pass kind= and engine_urls= with override_installer=True",
                           revision=mark.version, field="installer")
    return make_installer(InstallerSettings(kind=mark.installer, engine_urls=list(mark.engine_urls)))


def run_recover(params: RecoverParams, *, installer=None) -> RecoverResult:
    """Repair the store; if poisoned, re-install and activate a verified checkpoint, then clear the mark."""
    store = LocalStore(params.cache_dir, params.model, create=False)
    if not store.exists:
        return RecoverResult(FAILED, None, error=f"no store for {params.model} under {params.cache_dir}: "
                             "check model= and cache_dir=")
    try:
        with store.exclusive(params.lock_timeout_s, "recovery") as lock:
            repairs = store.recover()
            mark, active = store.poisoned() or store.fence(), store.active()
            if mark is None:
                current = store.current()
                return RecoverResult(
                    READY, active.version if active else None, active.installer if active else None,
                    detail=(f"not poisoned: nothing to re-install; installed {active.version if active else 'none'}, "
                            f"prepared {current.version if current else 'none'}"), repairs=repairs)
            from tasks.install import install_checkpoint  # a re-install: the stages, only when there is one to do
            from tasks.verify_digest import VerifiedTarget

            chosen = choose_installer(mark, params, installer)
            candidates = [store.current()] + ([store.verified(active.version)] if active is not None else [])
            record = next((c for c in candidates if c is not None), None)
            if record is None:
                raise StoreError("no verified checkpoint is left to re-install; run a refit (it rebuilds one and "
                                 "installs it once recovered), then `recover` again", file=str(store.root))
            store.point_at(record)
            lock.downgrade()  # the installation fence
            receipt = install_checkpoint(store, chosen, VerifiedTarget(record, store.absolute(record.path)),
                                         recovering=True)
            store.activate(record.version, receipt.installer)
    except (InstallError, StoreError) as exc:
        poisoned = store.poisoned() is not None
        return RecoverResult(POISONED if poisoned else FAILED, None, error=str(exc))
    rewritten = rewrite_node_record(params, chosen)
    return RecoverResult(READY, record.version, receipt.installer,
                         detail=f"re-installed {record.version} through {receipt.installer} and cleared the "
                                f"poisoned mark ({receipt.detail})"
                                + (f"; the node's status record now says {rewritten}" if rewritten else ""),
                         repairs=repairs, node_record=rewritten)


def rewrite_node_record(params: RecoverParams, installer) -> str | None:
    """After a recovery cleared the poisoned mark: this node's status record rewritten at once, as an idle
    heartbeat would (the engines asked; ``READY`` once they confirm the installed version), when the node's
    ``catalog`` is configured and the node already has a record there (a recovery never registers a node).
    Returns the status written; None if none was (best effort: the recovery itself succeeded)."""
    if not params.catalog:
        return None
    from flows.node_report import refresh_node
    from storage.catalog.nodes import scan_node_records
    from storage.errors import RefitError
    from storage.objects.store import ObjectStore
    from storage.settings import RefitParams, default_node_name

    try:
        refit = RefitParams(catalog=params.catalog, model=params.model, node=params.node or default_node_name(),
                            cache_dir=params.cache_dir, storage=params.storage)
        scan = scan_node_records(ObjectStore.shared(refit.storage), refit.catalog, refit.model, only=refit.node)
        if not any(r.node == refit.node for r in scan.records):
            return None
        written = refresh_node(refit, installer)
    except (RefitError, ValueError) as exc:
        log.warning("recovered, but could not rewrite the status record of node %s: %s", params.node, exc)
        return None
    return None if written is None else str(written.status)


def _recover(params: RecoverParams) -> dict:
    """Re-install a poisoned node's last verified checkpoint through its recorded installer."""
    result = run_recover(params)
    if result.status != READY:
        raise InstallError(result.error or result.status)
    return result.to_json()


def __getattr__(name: str):
    """``recover``, the Prefect flow over ``run_recover``, built on first use: ``python -m flows.refit recover``
    runs ``run_recover`` plainly and never imports Prefect."""
    if name != "recover":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from prefect import flow

    globals()["recover"] = flow(name="recover", flow_run_name="recover {params.model}",
                                validate_parameters=True)(_recover)
    return globals()["recover"]
