"""What a flow run may choose on this node: the node's own configuration is pinned, a run picks the rest.

A node agent (``python -m deployments.serve``) runs the flow runs of its
deployments in-process. Anyone who can create a flow run on the Prefect server
chooses that run's parameters, so the agent never runs them as they come: it
runs its own configuration (what ``serve`` parsed from its flags and its
``CANONICAL_REFIT_*`` environment), with only the fields a run may choose taken
from the run.

A refit run may choose ``target`` and ``only_if_newer`` (``RUN_CHOOSES``), and
whichever of the tuning fields in ``MAY_BE_OPENED`` the agent opens with
``--run-may-set FIELD``. Every other parameter is pinned: a run that names one
with the node's own value is fine (the deployments' default parameters carry
the catalog, model and node), one that names it with another value, or names a
parameter the flow does not have, is refused as a whole (``RunRefused``, every
offending parameter named by its dotted path, e.g. ``params.installer.engine_urls``).
The engines' admin key is never accepted from a run. The run is then never
executed: nothing is downloaded, written or installed.

A publish run (only where the agent serves the publish deployment,
``--serve-publish``) may choose how to publish, but not where to: its catalog,
model, object storage, payload location, the publisher's own state folder and
its signing key are the agent's, and its checkpoint (and base checkpoint) must
lie, symlinks resolved, inside one of the agent's ``--publish-checkpoint-root``
folders.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from pydantic import BaseModel, TypeAdapter, ValidationError

from storage.errors import RefitError
from storage.settings import PublishParams, RefitParams

RUN_CHOOSES = ("target", "only_if_newer")
# tuning a node may open to its runs, one by one (--run-may-set FIELD); nothing that says where bytes come from,
# where they go, which engines hear about them or whether an older version may be installed
MAY_BE_OPENED = ("verify", "activate", "apply_workers", "lock_timeout_s", "retries", "retry_delay_s",
                 "stage_retries", "stage_retry_delay_s")
NEVER_FROM_A_RUN = {("installer", "api_key")}  # secrets: refused even when equal (no probing by comparison)
# what a publish run may not change: where the revision goes and with which credentials, and the publisher's state
PUBLISH_PINNED = tuple(name for name in ("catalog", "model", "storage", "payload_url", "state_dir",
                                         "allow_unconditional_writes", "signing_key")
                       if name in PublishParams.model_fields)  # the signing key: the agent's own, or none
PUBLISH_PATHS = ("checkpoint", "base_checkpoint")  # read from the node's disk: inside a checkpoint root only


class RunRefused(RefitError):
    """A flow run asked for what this node's configuration does not allow; it was not executed."""

    def __init__(self, flow: str, offending: list[str], allowed: Iterable[str], detail: str = ""):
        self.flow = flow
        self.offending = list(offending)
        self.allowed = tuple(allowed)
        message = (f"refused: this node runs {flow} with its own configuration; a run may set only "
                   f"{', '.join(self.allowed)}, and this one set {', '.join(self.offending)}"
                   + (f" ({detail})" if detail else "")
                   + "; nothing was downloaded, written or installed")
        super().__init__(message)


@lru_cache(maxsize=None)
def _adapter(annotation) -> TypeAdapter:
    return TypeAdapter(annotation)


def _same(annotation, pinned: Any, value: Any) -> bool:
    """Whether a run's ``value`` is the pinned one, once read as the field's type (``/x/`` is ``/x``)."""
    if value == pinned:
        return True
    try:
        return _adapter(annotation).validate_python(value) == pinned
    except (ValidationError, TypeError, ValueError):
        return False


def differing(model: BaseModel, given: Any, prefix: str, *, only: Iterable[str] | None = None,
              skip: Iterable[str] = ()) -> list[str]:
    """Dotted names of the parameters in ``given`` that are not ``model``'s own value (unknown names too).

    ``only``: compare just these fields (others are skipped); ``skip``: fields
    the caller checks itself. Nested settings are compared field by field.
    """
    if not isinstance(given, dict):
        return [prefix]
    fields = type(model).model_fields
    skip = set(skip)
    out = []
    for key, value in given.items():
        name = f"{prefix}.{key}"
        info = fields.get(key)
        if info is None:
            out.append(f"{name} (unknown)")
            continue
        if key in skip or (only is not None and key not in only):
            continue
        if (prefix.rsplit(".", 1)[-1], key) in NEVER_FROM_A_RUN:
            out.append(name)
            continue
        pinned = getattr(model, key)
        if isinstance(pinned, BaseModel):
            out += differing(pinned, value, name)
        elif not _same(info.annotation, pinned, value):
            out.append(name)
    return out


def _top_level(parameters: dict) -> tuple[dict, list[str]]:
    """The run's ``params`` and the names of any other top-level parameter (the flows take ``params`` only)."""
    if not isinstance(parameters, dict):
        return {}, ["parameters"]
    others = [f"{key} (unknown)" for key in parameters if key != "params"]
    params = parameters.get("params", {})
    return params, others


def _invalid(exc: ValidationError, prefix: str = "params") -> list[str]:
    return [f"{prefix}.{'.'.join(map(str, e['loc']))} ({e['msg']})" for e in exc.errors()]


@dataclass(frozen=True)
class RefitPins:
    """The refit configuration of a node's agent, and what its runs may choose."""

    node: RefitParams  # the agent's own configuration, rollback policy included
    run_may_set: tuple[str, ...] = ()

    def __post_init__(self):
        bad = [name for name in self.run_may_set if name not in MAY_BE_OPENED]
        if bad:
            raise ValueError(f"a run may not be allowed to set {', '.join(bad)}: only {', '.join(MAY_BE_OPENED)}")

    @property
    def allowed(self) -> tuple[str, ...]:
        return RUN_CHOOSES + tuple(n for n in self.run_may_set if n not in RUN_CHOOSES)

    def parameters_for(self, parameters: dict) -> dict:
        """The parameters to run a refit with: the node's configuration plus what the run may choose; or
        ``RunRefused`` naming every parameter it may not set."""
        params, offending = _top_level(parameters)
        allowed = self.allowed
        offending += differing(self.node, params, "params", skip=allowed)
        chosen = {key: value for key, value in (params if isinstance(params, dict) else {}).items()
                  if key in allowed}
        if not offending and chosen:
            try:  # the field validators (a target's form) on the chosen values; the rest is the node's
                checked = RefitParams.model_validate({**self.node.model_dump(include={"catalog", "model"}),
                                                      **chosen})
            except ValidationError as exc:  # only the chosen values can be wrong: the node's are valid
                offending += _invalid(exc)
            else:
                chosen = {key: getattr(checked, key) for key in chosen}
        if offending:
            raise RunRefused("refit", offending, allowed)
        return {"params": self.node.model_copy(update=chosen)}


@dataclass(frozen=True)
class PublishPins:
    """The publish configuration of a node's agent (``--serve-publish``): where it publishes, from which folders."""

    node: PublishParams  # built with a placeholder checkpoint: only its pinned fields count
    checkpoint_roots: tuple[Path, ...] = field(default=())

    @property
    def allowed(self) -> tuple[str, ...]:
        return tuple(n for n in PublishParams.model_fields if n not in PUBLISH_PINNED)

    def outside_roots(self, path: Any) -> bool:
        """Whether ``path`` (symlinks resolved), or anything directly in it, lies outside every checkpoint root."""
        try:
            resolved = Path(os.fspath(path)).resolve()
        except (TypeError, ValueError, OSError):
            return True
        roots = [Path(root).resolve() for root in self.checkpoint_roots]

        def inside(p: Path) -> bool:
            return any(p == root or p.is_relative_to(root) for root in roots)

        if not inside(resolved):
            return True
        if resolved.is_dir():  # a file of the checkpoint may be a link out of the root
            with os.scandir(resolved) as entries:
                return any(not inside(Path(entry.path).resolve()) for entry in entries)
        return False

    def parameters_for(self, parameters: dict) -> dict:
        """The parameters to publish with, or ``RunRefused`` naming every parameter the run may not set."""
        params, offending = _top_level(parameters)
        offending += differing(self.node, params, "params", only=PUBLISH_PINNED)
        if isinstance(params, dict):
            offending += [f"params.{key} (outside the checkpoint roots)" for key in PUBLISH_PATHS
                          if params.get(key) is not None and self.outside_roots(params[key])]
        if offending:
            raise RunRefused("publish", offending, self.allowed,
                             f"checkpoint roots: {', '.join(map(str, self.checkpoint_roots)) or 'none'}")
        chosen = {key: value for key, value in params.items() if key not in PUBLISH_PINNED}
        pinned = {key: getattr(self.node, key) for key in PUBLISH_PINNED}
        try:
            checked = PublishParams.model_validate({**chosen, **self.node.model_dump(include={"catalog", "model"})})
        except ValidationError as exc:
            raise RunRefused("publish", _invalid(exc), self.allowed) from None
        return {"params": checked.model_copy(update=pinned)}


def publish_pins(node: RefitParams, roots: Iterable[Path], state_dir: Path | None = None) -> PublishPins:
    """The publish configuration of an agent whose refit configuration is ``node``: its catalog, model and
    object storage; the publisher's copy under ``state_dir`` (default: ``publisher`` in the node's store root)."""
    pinned = PublishParams(catalog=node.catalog, model=node.model, checkpoint=Path("/"),
                           storage=node.storage, state_dir=state_dir or Path(node.cache_dir) / "publisher",
                           payload_url=None, allow_unconditional_writes=False)
    return PublishPins(pinned, tuple(Path(r) for r in roots))
