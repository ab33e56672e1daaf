"""Runs whose node agent is gone: claims that name their process, and Prefect's zombie-run automation.

A run the agent claims carries its claimant in the ``Pending`` state's
message (host, boot, pid and process start time): an agent restarted on the
same host closes its predecessor's runs at once (``crash_orphans``). For
every other case (a lost host, an evicted pod, a node that never comes back)
the server closes them itself: every refit run sends Prefect's flow-run
heartbeats, and each agent makes sure the server has the automation Prefect
documents for zombie runs (``zombie_automation``).
"""

from __future__ import annotations

import logging
import os
import re
import socket
from pathlib import Path

log = logging.getLogger("canonical_refit.agent")
CLAIM = "claimed by node agent"
RUN_TAG = "canonical-refit"  # every deployment's tag (deployments/serve.py): what the zombie automation matches
ZOMBIE_AUTOMATION = "canonical-refit: crash refit runs whose heartbeats stopped"
# the names a run of ours ends in (each state change is the event prefect.flow-run.<name>)
FINAL_STATE_NAMES = ("Ready", "Skipped", "Poisoned", "Interrupted", "Failed", "Completed", "Cancelled", "Crashed",
                     "TimedOut")
_CLAIM_RE = re.compile(rf"{CLAIM} host=(?P<host>\S+) boot=(?P<boot>\S+) pid=(?P<pid>\d+) start=(?P<start>\d+)")


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8] or "unknown"
    except OSError:
        return "unknown"


def _start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), or None if there is no such process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def agent_identity(pid: int | None = None) -> str:
    """``host=... boot=... pid=... start=...``: this process, told apart from a later one with the same pid."""
    pid = os.getpid() if pid is None else pid
    return f"host={socket.gethostname()} boot={_boot_id()} pid={pid} start={_start_ticks(pid) or 0}"


def claimant_gone(message: str | None) -> bool:
    """True if ``message`` names a claimant process on this host that no longer runs (never for another host)."""
    found = _CLAIM_RE.search(message or "")
    if found is None or found["host"] != socket.gethostname():
        return False
    if found["boot"] != _boot_id():
        return True  # the host rebooted since
    start = _start_ticks(int(found["pid"]))
    return start is None or str(start) != found["start"]


def zombie_automation(within_s: float):
    """Prefect's documented zombie-run automation, for our runs: after a flow-run heartbeat of a run tagged
    ``canonical-refit``, expect another heartbeat or a final state within ``within_s``; otherwise mark the run
    ``Crashed`` (its process is gone: kill -9, a lost host, an evicted pod)."""
    from datetime import timedelta

    from prefect.automations import Automation, EventTrigger, Posture
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState

    return Automation(
        name=ZOMBIE_AUTOMATION,
        description="A refit run stopped sending heartbeats without ending: its node agent is gone. The node's "
                    "store recovers by itself on its next refit.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{name}" for name in FINAL_STATE_NAMES)},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.role": "tag", "prefect.resource.id": f"prefect.tag.{RUN_TAG}"},
            for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
            within=timedelta(seconds=within_s)),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message=(
            f"no heartbeat for {within_s:.0f}s: the node agent that ran it is gone; the node's store recovers on "
            "its next refit"))],
    )


def ensure_zombie_automation(client, within_s: float) -> None:
    """Create (or correct) the server's ``zombie_automation``; every agent asks, one exists.

    Agents started at the same moment may each find none and create one: every agent then keeps the one
    with the smallest id and deletes the others, so they all keep the same one and the server ends with one.
    """
    from prefect.events.schemas.automations import AutomationCore

    wanted = AutomationCore.model_validate(zombie_automation(within_s).model_dump(exclude={"id"}))
    try:
        existing = client.read_automations_by_name(ZOMBIE_AUTOMATION)
        if not existing:
            client.create_automation(wanted)
            log.info("created the automation %r (a run silent for %.0fs is Crashed)", ZOMBIE_AUTOMATION, within_s)
            existing = client.read_automations_by_name(ZOMBIE_AUTOMATION)
        kept, *extra = sorted(existing, key=lambda automation: str(automation.id))
        for duplicate in extra:  # created by an agent that started beside this one
            try:
                client.delete_automation(duplicate.id)
                log.info("deleted a duplicate of the automation %r (%s)", ZOMBIE_AUTOMATION, duplicate.id)
            except Exception as exc:  # another agent deleted it first
                log.debug("the duplicate %s of %r was not deleted here: %s", duplicate.id, ZOMBIE_AUTOMATION, exc)
        if kept.trigger.within != wanted.trigger.within:
            client.update_automation(kept.id, wanted)
            log.info("set the automation %r to %.0fs", ZOMBIE_AUTOMATION, within_s)
    except Exception as exc:  # the node still refits; only the server's cleanup of a dead agent's runs is missing
        log.warning("could not create the automation %r (runs of a killed agent stay Running until it "
                    "restarts on this host): %s", ZOMBIE_AUTOMATION, exc)


def crash_orphans(client, ids: list) -> int:
    """Mark ``Crashed`` the runs of these deployments left in progress by an agent process that is gone."""
    from prefect.client.schemas.filters import (
        DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    in_progress = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
        any_=[StateType.PENDING, StateType.RUNNING, StateType.CANCELLING])))
    runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=ids)),
                                 flow_run_filter=in_progress)
    crashed = 0
    for run in runs:
        claims = [s.message for s in client.read_flow_run_states(run.id)
                  if s.type == StateType.PENDING and s.message and CLAIM in s.message]
        if not claims or not claimant_gone(claims[-1]):
            continue
        owner = _CLAIM_RE.search(claims[-1])
        message = (f"the node agent that ran it (pid {owner['pid']} on {owner['host']}) is gone; the node's "
                   "store recovers on its next refit")
        client.set_flow_run_state(run.id, Crashed(message=message), force=True)
        log.warning("flow run %s was left %s by a node agent that is gone: marked Crashed", run.name,
                    run.state_name)
        crashed += 1
    return crashed
