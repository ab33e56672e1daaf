"""What the Prefect UI shows of a refit run: a name naming the node and the versions, the node's tag, and a
failure logged at ERROR.

* **Name.** Every refit run is named ``refit NODE: MODEL FROM -> TO``: the
  version the node's store had installed when the run started (``none``
  before the first install) and the run's target (a version, or ``latest``).
  A node agent that names its runs (``refit gpu1 r41 -> r42`` when its head
  check found r42 newer than the installed r41; ``refit gpu1 -> latest
  (start-up)``) keeps its versions: the run becomes ``refit gpu1: org/name
  r41 -> r42``; any other name that starts with ``refit `` is kept as it is.
  Prefect's generated names (``crimson-fox``, a run the server's automation or
  the UI created) give way to the node's.
* **Tag.** Runs of a node's deployments carry ``node:NAME`` (the deployments
  do); a one-off run (``python -m flows.refit``, ``flows.api.refit`` inside a
  flow run) is created under the same tag (``node_tag``).
* **ERROR.** A run that ends Failed or Poisoned logs its error at ERROR in
  the run's logs, naming the stage, and the revision, file and tensor at
  fault (the error's own words); an interrupted one at WARNING.
"""

from __future__ import annotations

import logging

from flows.report import FAILED, INTERRUPTED, POISONED, RefitResult, failed_stage

log = logging.getLogger("canonical_refit.refit")


def node_tag(node: str) -> str:
    """The tag of a node's runs (the UI's filter for one node)."""
    return f"node:{node}"


def run_name(given: str | None, *, node: str, model: str, installed: str | None, target: str) -> str:
    """The name of a refit run of ``node`` (see the module): the name ``given`` when it is one of ours, with the
    model and the installed version filled in where the agent's form leaves them out."""
    ours = f"refit {node} "
    if given and given.startswith(ours) and not given.startswith(f"refit {node}: "):
        detail = given[len(ours):].strip()
        if detail.startswith("->"):
            detail = f"{installed or 'none'} {detail}"
        return f"refit {node}: {model} {detail}"
    if given and given.startswith("refit "):
        return given
    return f"refit {node}: {model} {installed or 'none'} -> {target}"


def refit_run_name() -> str:
    """The refit flow's ``flow_run_name``: ``run_name`` for the run Prefect is starting (its current name, its
    parameters, and what the node's store has installed now)."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    params = (context.parameters or {}).get("params") if context is not None else None
    given = context.flow_run.name if context is not None and context.flow_run is not None else None
    value = (lambda name: params.get(name)) if isinstance(params, dict) else (lambda name: getattr(params, name, None))
    node, model = value("node"), value("model")
    if not node or not model:  # parameters Prefect could not give: its own name stays readable
        return given or "refit"
    return run_name(given, node=node, model=model, installed=_installed(value("cache_dir"), model),
                    target=value("target") or "latest")


def _installed(cache_dir, model: str) -> str | None:
    """The version the node's store records as installed; None if none or unreadable (a name is no reason to
    fail a run)."""
    from storage.errors import RefitError
    from storage.store.local_store import LocalStore

    try:
        store = LocalStore(cache_dir, model, create=False)
        active = store.active() if store.exists else None
    except (RefitError, OSError, TypeError, ValueError):
        return None
    return active.version if active is not None else None


def log_outcome(node: str, model: str, target: str, result: RefitResult) -> None:
    """A run that did not end well says so in its logs: ERROR for Failed and Poisoned (the failed stage and the
    error, which names the revision, file and tensor at fault), WARNING for Interrupted."""
    if result.status not in (FAILED, POISONED, INTERRUPTED):
        return
    stage = failed_stage(result)
    where = f" in {stage}" if stage else ""
    (log.warning if result.status == INTERRUPTED else log.error)(
        "refit of node %s (%s) to %s ended %s%s: %s%s", node, model, target, result.status, where,
        result.error or result.status, f"; next: {result.next_step}" if result.next_step else "")
