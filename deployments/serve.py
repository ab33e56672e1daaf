"""The node agent: this host's refit and publish deployments, run warm in one long-lived process.

    export PREFECT_API_URL=http://127.0.0.1:4200/api
    python -m deployments.serve --catalog s3://bucket/catalog --model org/name \\
        --seed-checkpoint /models/launch --node gpu-node-3

The node is configured as the CLI configures it: flags first, then the
``CANONICAL_REFIT_*`` environment variables (``storage/settings.py``). The
process registers its deployments on the server ``PREFECT_API_URL`` names
(with ``PREFECT_API_AUTH_STRING`` where the server requires credentials) and
runs their flow runs in this process (``deployments/agent.py``), one at a
time, so no Python or Prefect start-up is paid per run:

* ``refit/refit-latest`` refits to the catalog's latest revision every
  ``--interval`` seconds, when it is newer than the installed one;
* ``refit/refit-on-publish`` holds the refits the agent's reconcile loop
  creates: a ``canonical-refit.revision.published`` event for this model (or
  the catalog's head, checked every ``--head-poll-seconds``) names a version
  newer than the installed one, and the loop creates one run with the newest
  such version as its target (a burst of publications is one run; an event
  delivered again is none). No server automation is attached to it (one that
  an older version of this command attached is removed when the deployment
  is registered again); ``deployments/prefect.yaml``, for a stock worker
  without this agent, keeps its event trigger;
* ``publish/publish``, only with ``--serve-publish``: the trainer side, run with a checkpoint
  from under a ``--publish-checkpoint-root`` as a parameter.

Runs never overlap (a publish run queues behind a refit, too). At start it
schedules one run of ``refit-latest`` at once, so a new or restarted node
catches up without waiting for the interval. Every flow run runs with the
node's own configuration (``deployments/pinning.py``): a run chooses its target
and ``only_if_newer`` (and what ``--run-may-set`` opens); one that names another
catalog, store, engine, endpoint or any other setting is refused without running,
and one whose target is older than the installed version is refused unless
``--allow-remote-rollback``.
On SIGTERM or Ctrl-C the run in progress stops at its next safe point and
the agent exits; runs that events create meanwhile wait, scheduled, until it
is started again. See docs/operations.md.
"""

from __future__ import annotations

import os
import argparse
import json
import re
import logging
import time
import sys
from datetime import timedelta
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from deployments.pinning import MAY_BE_OPENED, RefitPins, publish_pins
from flows.options import add_flags, build, field_errors, flags, given, with_values
from storage.settings import RefitParams, Settings, settings_config

log = logging.getLogger("canonical_refit.serve")
EVENT = "canonical-refit.revision.published"  # flows.publish.EVENT, without importing Prefect here
TAGS = ["canonical-refit"]
FAN_OUT_DEPRECATED = ("warning: --fan-out automation is deprecated and has no effect: the agent's reconcile loop "
                      "(published events wake it; the catalog's head check, every --head-poll-seconds, catches up) "
                      "is the only path from a publication to this node's refit, and no server automation is "
                      "created; drop the flag (docs/fleet.md)")


class ServeSettings(Settings):
    """How the deployments are served (env prefix ``CANONICAL_REFIT_SERVE_``)."""

    model_config = settings_config("CANONICAL_REFIT_SERVE_")

    interval_s: float = Field(3600.0, gt=0, description="seconds between scheduled refits to 'latest'",
                              json_schema_extra={"flag": "--interval"})
    name_suffix: str | None = Field(
        None, description="appended to each deployment name (default: '-' and the node name, so each node has its "
                          "own deployments); 'gpu3' and '-gpu3' both give 'refit-latest-gpu3'; '' for none")

    @field_validator("name_suffix")
    @classmethod
    def _suffix_form(cls, value: str | None) -> str | None:
        if not value:
            return value
        value = value if value.startswith("-") else f"-{value}"
        if not re.match(r"^-[a-z0-9][a-z0-9-]{0,62}$", value):
            raise ValueError(f"name suffix {value!r} must be lowercase letters, digits and dashes")
        return value

    def zombie_window_s(self) -> float | None:
        """``zombie_after_s``, or three of Prefect's flow-run heartbeats; None when heartbeats are off."""
        if self.zombie_after_s is not None:
            return self.zombie_after_s
        from prefect.settings import get_current_settings

        frequency = get_current_settings().flows.heartbeat_frequency
        return None if frequency is None else 3.0 * max(frequency, 30)

    def suffix_for(self, node: str) -> str:
        """The suffix in force: the one given, or one derived from the node name."""
        if self.name_suffix is not None:
            return self.name_suffix
        return "-" + (re.sub(r"[^a-z0-9]+", "-", node.lower()).strip("-")[:62] or "node")
    poll_s: float = Field(10.0, ge=0.05, le=600,
                          description="seconds between the agent's queries for flow runs to start (each is one API "
                                      "request while idle); triggered runs start at once anyway, on their "
                                      "scheduled-run event (docs/fleet.md)",
                          json_schema_extra={"flag": "--poll-seconds"})
    head_poll_s: float = Field(30.0, ge=1, le=60,
                               description="seconds between the agent's checks of the catalog's head (a few object "
                                           "reads): a publication whose event was lost, or a refit that failed on a "
                                           "transient error, is caught up within this (at most 60 s)",
                               json_schema_extra={"flag": "--head-poll-seconds"})
    heartbeat_s: float = Field(30.0, ge=1, le=3600,
                               description="seconds between refreshes of this node's status record (alive, and what "
                                           "its engines run; a drift found is healed by a refit); readers count a "
                                           "node stale after one beat plus a grace",
                               json_schema_extra={"flag": "--heartbeat-seconds"})
    zombie_after_s: float | None = Field(
        None, ge=30, description="a refit run whose Prefect flow-run heartbeats stop for this many seconds without "
                                 "a final state is marked Crashed by a server automation (its agent is gone); "
                                 "default: three heartbeats (PREFECT_FLOWS_HEARTBEAT_FREQUENCY, 180 s by default)",
        json_schema_extra={"flag": "--zombie-after"})
    fan_out: Literal["automation", "agent"] = Field(
        "agent", description="deprecated, kept for compatibility: the agent's reconcile loop is the only path from "
                             "a publication to this node's run ('agent' changes nothing; 'automation' warns and "
                             "behaves the same; docs/fleet.md)")
    wake_on_events: bool = Field(True, description="wake the agent when a run of its deployments is scheduled, from "
                                                   "the server's event stream (one websocket per node), so that "
                                                   "triggered runs start at once; without it only the polls find them",
                                 json_schema_extra={"flag": "--no-event-wakeups"})
    run_may_set: list[Literal[MAY_BE_OPENED]] = Field(
        default_factory=list, description=f"a refit setting this node lets each run choose, besides target and "
                                          f"only_if_newer: one of {', '.join(MAY_BE_OPENED)} (every other "
                                          "parameter is pinned to this node's configuration: a run that sets one "
                                          "otherwise is refused)")
    allow_remote_rollback: bool = Field(
        False, description="let a run of the control plane install a version older than the installed one (it is "
                           "recorded as a rollback); refused by default")
    publish: bool = Field(False, description="also register the publish deployment, which publishes from this "
                                             "node's disk into its catalog (off by default: inference nodes do not "
                                             "publish)", json_schema_extra={"flag": "--serve-publish"})
    publish_checkpoint_roots: list[Path] = Field(
        default_factory=list, description="with --serve-publish: a folder the checkpoints of publish runs must lie "
                                          "in (symlinks resolved)",
        json_schema_extra={"flag": "--publish-checkpoint-root"})

    @model_validator(mode="after")
    def _publish_has_roots(self) -> "ServeSettings":
        if self.publish and not self.publish_checkpoint_roots:
            raise ValueError("--serve-publish needs at least one --publish-checkpoint-root, the folders a publish "
                             "run may read a checkpoint from")
        return self


def resource_id(model: str, version: str) -> str:
    """Resource id of the published event for ``model``'s ``version`` (docs/format.md, section 6)."""
    return f"canonical-refit.revision.{model}.{version}"


def refit_parameters(params: RefitParams, **overrides) -> dict:
    """Deployment parameters: the settings the operator gave (flags or environment) plus ``overrides``.

    Settings left at their defaults stay out, and so do the nested object-storage
    and installer settings unless flags set them: the process that runs the flow
    fills those in from its own ``CANONICAL_REFIT_*`` environment. Secrets never
    appear (the installer's API key is excluded from dumps).
    """
    values = params.model_dump(mode="json", exclude_unset=True)
    values.update(overrides)
    return {"params": values}


def on_publish_trigger(params: RefitParams, name_suffix: str = ""):
    """The event trigger ``deployments/prefect.yaml`` gives ``refit-on-publish`` for a stock worker (this model's
    published events, the event's version as target). ``build_deployments`` attaches none: the agent's reconcile
    loop creates the runs."""
    from prefect.events import DeploymentEventTrigger

    return DeploymentEventTrigger(
        name=f"refit {params.model} on publication{name_suffix}",
        expect={EVENT},
        match={"prefect.resource.id": resource_id(params.model, "*")},
        parameters=refit_parameters(params, target="{{ event.payload.version }}", only_if_newer=True),
    )


def build_deployments(params: RefitParams, settings: ServeSettings) -> list:
    """The runner deployments: refit-latest, refit-on-publish, and publish with ``--serve-publish``."""
    from flows.publish import publish
    from flows.refit import refit
    from flows.run_labels import node_tag

    suffix = settings.suffix_for(params.node)
    latest = refit.to_deployment(
        f"refit-latest{suffix}",
        interval=timedelta(seconds=settings.interval_s),
        parameters=refit_parameters(params, target="latest", only_if_newer=True),
        description=f"Refit {params.model} to the latest revision of {params.catalog} when it is newer.",
        tags=[*TAGS, node_tag(params.node)],
    )
    on_publish = refit.to_deployment(
        f"refit-on-publish{suffix}",
        triggers=[],  # re-applied, this also removes the automation an older version attached (Prefect's apply)
        parameters=refit_parameters(params, target="latest", only_if_newer=True),
        description=f"Refits of {params.model} the node's agent creates when a version newer than the installed "
                    f"one is published ({EVENT}, or the catalog's head); one run for the newest of a burst.",
        tags=[*TAGS, node_tag(params.node)],
    )
    if not settings.publish:
        return [latest, on_publish]
    trainer = publish.to_deployment(
        f"publish{suffix}",
        description=f"Publish a checkpoint of {params.model} to {params.catalog}: pass catalog and model (this "
                    f"node's) and a checkpoint under {', '.join(map(str, settings.publish_checkpoint_roots))}.",
        tags=TAGS,
    )
    return [latest, on_publish, trainer]


def pinned_params(params: RefitParams, settings: ServeSettings) -> RefitParams:
    """The node's refit configuration as its runs get it: its rollback policy is the agent's
    (``--allow-remote-rollback``), whatever the environment says."""
    return params.model_copy(update={"rollbacks": "allow" if settings.allow_remote_rollback else "refuse"})


def run_vetting(params: RefitParams, settings: ServeSettings) -> dict:
    """Flow name -> what turns a run's parameters into the ones it runs with (``deployments/pinning.py``)."""
    vet = {"refit": RefitPins(pinned_params(params, settings), tuple(settings.run_may_set)).parameters_for}
    if settings.publish:
        vet["publish"] = publish_pins(params, settings.publish_checkpoint_roots).parameters_for
    return vet


NODE_FLAGS = flags(RefitParams, "catalog", "model", "node", "seed_checkpoint", "initial_version", "cache_dir",
                   "cache_max_gb", "apply_workers", "installer.kind", "installer.engine_urls", "retries",
                   "retry_delay_s", "stage_retries", "stage_retry_delay_s", "stage_deadline_s", "storage.concurrency",
                   "storage.endpoint_url", "trusted_keys")
SERVE_FLAGS = flags(ServeSettings)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.serve",
        description="Register the refit-latest and refit-on-publish deployments (and publish, with --serve-publish) "
                    "on the Prefect server named by PREFECT_API_URL (credentials: PREFECT_API_AUTH_STRING) and run "
                    "their flow runs, one at a time, with this node's own configuration: a run chooses its target "
                    "and only_if_newer; one that sets anything else is refused. Settings not given as flags come "
                    "from CANONICAL_REFIT_* environment variables.")
    add_flags(parser, RefitParams, NODE_FLAGS)
    add_flags(parser, ServeSettings, SERVE_FLAGS)
    parser.add_argument("--print-params", action="store_true",
                        help="print the refit parameters as JSON for `prefect deployment run --params` and exit")
    parser.add_argument("--target", default="latest",
                        help="with --print-params: the version to refit to (default latest)")
    return parser


def parse_args(argv: list[str]) -> tuple[RefitParams, ServeSettings, argparse.Namespace]:
    """RefitParams and ServeSettings from the flags given; the environment fills in the rest."""
    parser = _parser()
    args = parser.parse_args(with_values(argv, NODE_FLAGS + SERVE_FLAGS))
    try:
        params, settings = build(RefitParams, given(args, NODE_FLAGS)), build(ServeSettings, given(args, SERVE_FLAGS))
    except ValidationError as exc:
        parser.error(field_errors(exc, NODE_FLAGS + SERVE_FLAGS))
    if settings.fan_out == "automation":
        print(FAN_OUT_DEPRECATED, file=sys.stderr)
    return params, settings, args


def node_environment(params: RefitParams) -> dict[str, str]:
    """The node's configuration as ``CANONICAL_REFIT_*`` variables, for code the runs of this process start.

    The runs themselves get the node's settings object (``run_vetting``), not
    these: nothing a run's parameters leave out is read back from the
    environment. Secrets are not in ``params`` (the API key stays in the environment).
    """
    env: dict[str, str] = {}
    values = params.model_dump(mode="json", exclude_unset=True)
    for name, value in values.items():
        if name in ("installer", "storage", "target", "only_if_newer"):
            continue
        env[f"CANONICAL_REFIT_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    for name, value in params.installer.model_dump(mode="json", exclude_unset=True).items():
        env[f"CANONICAL_REFIT_INSTALLER_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    for name, value in params.storage.model_dump(mode="json", exclude_unset=True).items():
        env[f"CANONICAL_REFIT_S3_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    return env


def api_url() -> str | None:
    """The Prefect API this process talks to (None: Prefect would start a private ephemeral server)."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    return str(url) if url else None


def main(argv: list[str] | None = None) -> int:
    from flows.bootstrap import bootstrap_command

    params, settings, args = parse_args(list(sys.argv[1:] if argv is None else argv))  # --help: no Prefect
    if args.print_params:
        print(json.dumps(refit_parameters(params, target=args.target, only_if_newer=args.target == "latest")))
        return 0
    if (code := bootstrap_command(log_to_stderr=True)) is not None:  # environment, logging, Prefect (checked)
        return code
    url = api_url()
    if not url:
        # an ephemeral server lives and dies with this process: no other process's event could reach it
        print("error: PREFECT_API_URL is not set. Start a server (prefect server start) and export "
              "PREFECT_API_URL=http://127.0.0.1:4200/api first.", file=sys.stderr)
        return 2
    from deployments.agent import Publications, serve_in_process
    from flows.publish import publish
    from flows.refit import refit

    os.environ.update(node_environment(params))  # ad-hoc runs use this node's store and engine
    deployments = build_deployments(params, settings)
    log.info("node %s serving %s for %s from %s on %s: refit-latest every %.0f s; the catalog's head checked every "
             "%.0f s%s; flow runs in this process, one at a time", params.node,
             ", ".join(d.name for d in deployments), params.model, params.catalog, url, settings.interval_s,
             settings.head_poll_s, f" and woken by {EVENT}" if settings.wake_on_events else "")
    from flows import node_report
    from flows.fleet_table import FleetTable
    from flows.outcome import last_refit_outcome
    from tasks.installers import make_installer

    node_report.heartbeat_interval_s = settings.heartbeat_s
    publications = Publications(  # the events that wake the loop (with --no-event-wakeups: none, the head check)
        f"refit-on-publish{settings.suffix_for(params.node)}", EVENT, resource_id(params.model, ""),
        lambda version: refit_parameters(params, target=version, only_if_newer=True), catalog=params.catalog)
    installer = make_installer(params.installer)  # one, for the heartbeats' questions to the engines
    stats = serve_in_process(deployments, {"refit": refit, "publish": publish}, vet=run_vetting(params, settings),
                             poll_s=settings.poll_s,
                             start_now=f"refit-latest{settings.suffix_for(params.node)}",
                             wake_on_events=settings.wake_on_events, heartbeat_s=settings.heartbeat_s,
                             heartbeat=FleetTable(params.catalog, params.model, node=params.node,  # fleet table
                                                  storage=params.storage, heartbeat_s=settings.heartbeat_s).beat(
                                 lambda busy: node_report.refresh_node(params, installer, busy=busy)),
                             zombie_after_s=settings.zombie_window_s(),
                             outcomes={"refit": last_refit_outcome}, publications=publications,
                             head_watch=node_report.HeadWatch(params), head_poll_s=settings.head_poll_s,
                             node=params.node)
    log.info("served %d flow run(s) with %d API polls in %.0fs", stats.runs, stats.polls,
             time.monotonic() - stats.started_at)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
