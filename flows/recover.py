"""Recovery of a poisoned node: re-install a verified checkpoint through the installer it was poisoned with.

``python -m flows.refit recover --model M --cache-dir D`` repairs the store
(as every run does) and, if the node is poisoned, re-installs the last
verified checkpoint through the installer and engines recorded in
``poisoned.json``, and clears the mark only once that install succeeded and
was activated. On a healthy node it repairs and says there was nothing to
re-install. Asking for a different installer than the recorded one is
refused unless ``override_installer`` says so explicitly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from storage.errors import InstallError, StoreError
from storage.format.status import FAILED, POISONED, READY, Status
from storage.store.local_store import LocalStore
from storage.settings import InstallerSettings, RecoverParams
from tasks.installers import make_installer


@dataclass
class RecoverResult:
    """What a recovery did, as ``recover --json`` prints it."""

    status: Status  # READY, FAILED or POISONED
    version: str | None
    installer: str | None = None
    detail: str = ""
    repairs: list[str] = field(default_factory=list)
    error: str | None = None

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
            f"recovery re-installs through it. You asked for {given!r} with {list(urls)}: leave out --installer "
            "and --engine-url to use the recorded one, or add --override-installer if the engines really moved",
            revision=mark.version, field="installer")
    if installer is not None:
        return installer
    if params.installer is not None:
        return make_installer(params.installer)
    if mark.installer not in ("none", "sglang", "sglang-disk"):
        raise InstallError(f"the node was poisoned through installer {mark.installer!r}, which cannot be rebuilt "
                           "from the command line; pass --installer and --engine-url with --override-installer",
                           revision=mark.version, field="installer")
    return make_installer(InstallerSettings(kind=mark.installer, engine_urls=list(mark.engine_urls)))


def run_recover(params: RecoverParams, *, installer=None) -> RecoverResult:
    """Repair the store; if poisoned, re-install and activate a verified checkpoint, then clear the mark."""
    store = LocalStore(params.cache_dir, params.model, create=False)
    if not store.exists:
        return RecoverResult(FAILED, None, error=f"no store for {params.model} under {params.cache_dir}: "
                             "check --model and --cache-dir")
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
    return RecoverResult(READY, record.version, receipt.installer,
                         detail=f"re-installed {record.version} through {receipt.installer} and cleared the "
                                f"poisoned mark ({receipt.detail})", repairs=repairs)


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
