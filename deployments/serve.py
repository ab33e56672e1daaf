"""Serve the refit and publish deployments from one process: one host, no work pool, no worker.

    export PREFECT_API_URL=http://127.0.0.1:4200/api
    python -m deployments.serve --catalog s3://bucket/catalog --model org/name \\
        --seed-checkpoint /models/launch --interval 3600

The receiver is configured as the CLI configures it: flags first, then the
``CANONICAL_REFIT_*`` environment variables (``storage/settings.py``). The
process registers three deployments on the server ``PREFECT_API_URL`` names
and runs their flow runs as subprocesses of itself:

* ``refit/refit-latest`` refits to the catalog's latest revision every
  ``--interval`` seconds, when it is newer than the installed one;
* ``refit/refit-on-publish`` runs on every ``canonical-refit.revision.published``
  event for this model, with the event's version as the target; a version that
  is not newer than the installed one ends in a ``Skipped`` state that says so;
* ``publish/publish`` is the trainer side, run with the checkpoint as a parameter.

It starts one flow run at a time, so refits of the model on this host never
overlap (a publish run queues behind a refit, too). On SIGTERM or Ctrl-C it
pauses its deployments and exits; runs that events create meanwhile wait as
scheduled runs until it is started again. See docs/operations.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "canonical_refit")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402

from pydantic import Field, ValidationError  # noqa: E402
from pydantic_settings import BaseSettings, SettingsConfigDict  # noqa: E402

from storage.settings import InstallerSettings, RefitParams  # noqa: E402

log = logging.getLogger("canonical_refit.serve")
EVENT = "canonical-refit.revision.published"  # flows.publish.EVENT, without importing Prefect here
TAGS = ["canonical-refit"]


class ServeSettings(BaseSettings):
    """How the deployments are served (env prefix ``CANONICAL_REFIT_SERVE_``)."""

    model_config = SettingsConfigDict(env_prefix="CANONICAL_REFIT_SERVE_", extra="ignore")

    interval_s: float = Field(3600.0, gt=0, description="seconds between scheduled refits to 'latest'")
    name_suffix: str = Field("", pattern=r"^(-[a-z0-9][a-z0-9-]{0,62})?$",
                             description="appended to each deployment name, e.g. '-gpu3' (one set per host)")
    poll_s: int = Field(5, ge=1, le=600, description="seconds between the runner's queries for runs to start")


def resource_id(model: str, version: str) -> str:
    """Resource id of the published event for ``model``'s ``version`` (SPEC section 11)."""
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
    """The event trigger of ``refit-on-publish``: this model's published events, the event's version as target."""
    from prefect.events import DeploymentEventTrigger

    return DeploymentEventTrigger(
        name=f"refit {params.model} on publication{name_suffix}",
        expect={EVENT},
        match={"prefect.resource.id": resource_id(params.model, "*")},
        parameters=refit_parameters(params, target="{{ event.payload.version }}", only_if_newer=True),
    )


def build_deployments(params: RefitParams, settings: ServeSettings) -> list:
    """The three runner deployments: refit-latest, refit-on-publish and publish."""
    from flows.publish import publish
    from flows.refit import refit

    suffix = settings.name_suffix
    latest = refit.to_deployment(
        f"refit-latest{suffix}",
        interval=timedelta(seconds=settings.interval_s),
        parameters=refit_parameters(params, target="latest", only_if_newer=True),
        description=f"Refit {params.model} to the latest revision of {params.catalog} when it is newer.",
        tags=TAGS,
    )
    on_publish = refit.to_deployment(
        f"refit-on-publish{suffix}",
        triggers=[on_publish_trigger(params, suffix)],
        parameters=refit_parameters(params, target="latest", only_if_newer=True),
        description=f"Refit {params.model} to each version announced by {EVENT}; older versions are skipped.",
        tags=TAGS,
    )
    trainer = publish.to_deployment(
        f"publish{suffix}",
        description=f"Publish a checkpoint of {params.model} to {params.catalog} (pass the full params).",
        tags=TAGS,
    )
    return [latest, on_publish, trainer]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.serve",
        description="Register the refit-latest, refit-on-publish and publish deployments on the Prefect "
                    "server named by PREFECT_API_URL and run their flow runs, one at a time. Settings not "
                    "given as flags come from CANONICAL_REFIT_* environment variables.")
    add = parser.add_argument
    add("--catalog", help="catalog URL (s3://bucket/prefix, file:///path or a local folder) "
        "[CANONICAL_REFIT_CATALOG]")
    add("--model", help="model id, e.g. org/name [CANONICAL_REFIT_MODEL]")
    add("--seed-checkpoint", help="local folder of the launch snapshot [CANONICAL_REFIT_SEED_CHECKPOINT]")
    add("--initial-version", help="launch revision (default: the sequence-0 record)")
    add("--cache-dir", help="root of the local checkpoint store [CANONICAL_REFIT_CACHE_DIR]")
    add("--cache-max-gb", type=float, help="byte quota of the store, decimal GB [CANONICAL_REFIT_CACHE_MAX_GB]")
    add("--apply-workers", type=int, help="threads applying tensors [CANONICAL_REFIT_APPLY_WORKERS]")
    add("--installer", choices=("none", "sglang", "sglang-disk"),
        help="how to install into the engine [CANONICAL_REFIT_INSTALLER_KIND]")
    add("--engine-url", action="append", default=[],
        help="engine base URL (repeat per replica) [CANONICAL_REFIT_INSTALLER_ENGINE_URLS, a JSON list]")
    add("--interval", type=float, help="seconds between scheduled refits [CANONICAL_REFIT_SERVE_INTERVAL_S]")
    add("--name-suffix", help="suffix of the deployment names, e.g. -gpu3 [CANONICAL_REFIT_SERVE_NAME_SUFFIX]")
    add("--poll-seconds", type=int,
        help="seconds between queries for runs to start [CANONICAL_REFIT_SERVE_POLL_S]")
    add("--print-params", action="store_true",
        help="print the refit parameters as JSON for `prefect deployment run --params` and exit")
    add("--target", default="latest", help="with --print-params: the version to refit to (default latest)")
    return parser


def parse_args(argv: list[str]) -> tuple[RefitParams, ServeSettings, argparse.Namespace]:
    """RefitParams and ServeSettings from the flags given; the environment fills in the rest."""
    parser = _parser()
    args = parser.parse_args(argv)
    given = {"catalog": args.catalog, "model": args.model, "seed_checkpoint": args.seed_checkpoint,
             "initial_version": args.initial_version, "cache_dir": args.cache_dir,
             "cache_max_gb": args.cache_max_gb, "apply_workers": args.apply_workers}
    values = {k: v for k, v in given.items() if v is not None}
    installer = {k: v for k, v in {"kind": args.installer, "engine_urls": args.engine_url or None}.items()
                 if v is not None}
    serve = {k: v for k, v in {"interval_s": args.interval, "name_suffix": args.name_suffix,
                                "poll_s": args.poll_seconds}.items() if v is not None}
    try:
        if installer:
            values["installer"] = InstallerSettings(**installer)
        return RefitParams(**values), ServeSettings(**serve), args
    except ValidationError as exc:
        parser.error(str(exc))


def api_url() -> str | None:
    """The Prefect API this process talks to (None: Prefect would start a private ephemeral server)."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    return str(url) if url else None


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per API poll otherwise
    params, settings, args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.print_params:
        print(json.dumps(refit_parameters(params, target=args.target, only_if_newer=args.target == "latest")))
        return 0
    url = api_url()
    if not url:
        # an ephemeral server lives and dies with this process: no other process's event could reach it
        print("error: PREFECT_API_URL is not set. Start a server (prefect server start) and export "
              "PREFECT_API_URL=http://127.0.0.1:4200/api first.", file=sys.stderr)
        return 2
    from prefect import serve

    deployments = build_deployments(params, settings)
    slug = re.sub(r"[^a-z0-9]+", "-", params.model.lower()).strip("-")
    log.info("serving %s for %s from %s on %s: refit-latest every %.0f s, refit-on-publish on %s; "
             "one flow run at a time", ", ".join(d.name for d in deployments), params.model, params.catalog,
             url, settings.interval_s, EVENT)
    # limit=1: one flow run at a time in this process, so two refits of the model never overlap
    serve(*deployments, limit=1, query_seconds=settings.poll_s,
          name=f"canonical-refit-{slug}{settings.name_suffix}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
