"""Command line of the receiver: ``python -m flows.refit [status|recover|activate] ...``."""

from __future__ import annotations

import argparse
import json
import sys

EXIT_READY, EXIT_FAILED, EXIT_USAGE, EXIT_POISONED = 0, 1, 2, 3
_COMMANDS = ("status", "recover", "activate")


def _store_flags(parser: argparse.ArgumentParser, *, catalog_required: bool) -> None:
    parser.add_argument("--catalog", required=catalog_required,
                        help="catalog URL: s3://bucket/prefix, file:///path or a local folder")
    parser.add_argument("--model", required=True, help="model id, e.g. org/name")
    parser.add_argument("--cache-dir", help="root of the local checkpoint store "
                        "(default: ~/.cache/canonical-refit or $CANONICAL_REFIT_CACHE_DIR)")
    parser.add_argument("--cache-max-gb", type=float, help="byte quota of the store in decimal GB (default 500)")
    parser.add_argument("--installer", choices=("none", "sglang", "sglang-disk"),
                        help="how to install into the engine (default: none)")
    parser.add_argument("--engine-url", action="append", default=[],
                        help="engine base URL, e.g. http://127.0.0.1:30000 (repeat for each replica)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flows.refit",
        description="Move the local checkpoint to a target revision, verify it and install it. "
                    "With no arguments at all, runs the embedded demo. Subcommands: status, recover, activate.",
    )
    _store_flags(parser, catalog_required=True)
    parser.add_argument("--target", help="version to install, or 'latest' (default)")
    parser.add_argument("--initial-version", help="launch revision (default: the catalog's sequence-0 record)")
    parser.add_argument("--seed-checkpoint", help="local folder of the launch Hugging Face snapshot")
    parser.add_argument("--apply-workers", type=int, help="threads applying tensors (default: cores, max 8)")
    parser.add_argument("--fetch-workers", type=int, help="objects downloaded at once (default 8)")
    parser.add_argument("--verify", choices=("incremental", "full"),
                        help="'full' rereads every tensor instead of reusing verified checksums")
    parser.add_argument("--no-activate", action="store_true",
                        help="install but defer activation to `python -m flows.refit activate`")
    parser.add_argument("--only-if-newer", action="store_true",
                        help="do nothing if the target is not newer than the installed revision")
    parser.add_argument("--lock-timeout", type=float, help="longest wait for another receiver's lock, seconds")
    return parser


def _sub_parser(command: str) -> argparse.ArgumentParser:
    helps = {
        "status": "print the store state and the installed identity",
        "recover": "re-install the last verified checkpoint and clear a poisoned mark",
        "activate": "record a checkpoint installed with --no-activate as the active version",
    }
    parser = argparse.ArgumentParser(prog=f"python -m flows.refit {command}", description=helps[command])
    _store_flags(parser, catalog_required=False)
    if command == "activate":
        parser.add_argument("--version", required=True, help="the installed version to activate")
    return parser


def build_params(args: argparse.Namespace):
    """RefitParams from the flags that were given; the environment fills in the rest."""
    from storage.settings import InstallerSettings, ObjectStoreSettings, RefitParams

    given = {
        "catalog": args.catalog or "unused://", "model": args.model,
        "target": getattr(args, "target", None), "initial_version": getattr(args, "initial_version", None),
        "seed_checkpoint": getattr(args, "seed_checkpoint", None), "cache_dir": args.cache_dir,
        "cache_max_gb": args.cache_max_gb, "apply_workers": getattr(args, "apply_workers", None),
        "verify": getattr(args, "verify", None), "lock_timeout_s": getattr(args, "lock_timeout", None),
        "only_if_newer": getattr(args, "only_if_newer", None) or None,
    }
    params = {k: v for k, v in given.items() if v is not None}
    if getattr(args, "no_activate", False):
        params["activate"] = False
    installer = {k: v for k, v in {"kind": args.installer, "engine_urls": args.engine_url or None}.items()
                 if v is not None}
    params["installer"] = InstallerSettings(**installer)
    if getattr(args, "fetch_workers", None):
        params["storage"] = ObjectStoreSettings(concurrency=args.fetch_workers)
    return RefitParams(**params)


def main(argv: list[str] | None = None, *, refit_flow=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        from flows.demo import run_demo

        return run_demo(refit_flow=refit_flow)
    from pydantic import ValidationError

    command = argv[0] if argv[0] in _COMMANDS else None
    parser = _sub_parser(command) if command else _run_parser()
    args = parser.parse_args(argv[1:] if command else argv)
    try:
        params = build_params(args)
    except ValidationError as exc:
        parser.error(str(exc))
    if command == "status":
        return _status(params, args)
    if command in ("recover", "activate"):
        return _recover_or_activate(command, params, args)
    if refit_flow is None:
        from flows.refit import refit as refit_flow
    state = refit_flow(params, return_state=True)
    result = result_of(state)
    if args.json:
        print(json.dumps(result.to_json(), indent=None, sort_keys=True))
    else:
        print_result(result)
    return {"READY": EXIT_READY, "SKIPPED": EXIT_READY, "POISONED": EXIT_POISONED}.get(result.status, EXIT_FAILED)


def result_of(state):
    """The RefitResult a final state carries (failed states carry it on their error)."""
    from flows.report import FAILED, RefitResult

    value = state.result(raise_on_failure=False)
    value = getattr(value, "result", value)
    if isinstance(value, RefitResult):
        return value
    return RefitResult(FAILED, None, None, None, None, error=f"{state.name}: {state.message}")


def print_result(result) -> None:
    """Human-readable stage table and identity."""
    print(f"{'stage':<16}{'status':<8}{'seconds':>9}{'bytes':>15}{'MB/s':>9}{'retries':>8}")
    for s in result.stages:
        rate = s["bytes"] / s["seconds"] / 1e6 if s["seconds"] else 0.0
        print(f"{s['name']:<16}{s['status']:<8}{s['seconds']:>9.3f}{s['bytes']:>15,}{rate:>9.1f}{s['retries']:>8}")
    print(f"status: {result.status}")
    print(f"version: {result.version}")
    print(f"target digest: {result.target_digest}")
    print(f"format digest: {result.format_digest}")
    print(f"checkpoint: {result.checkpoint_path}")
    if result.lineage:
        print(f"lineage: {' -> '.join(result.lineage)}")
    if result.error:
        print(f"error: {result.error}")


def _status(params, args) -> int:
    from storage.local_store import LocalStore

    info = LocalStore(params.cache_dir, params.model, quota_bytes=params.quota_bytes).describe()
    print(json.dumps(info, indent=None if args.json else 2, sort_keys=True, default=str))
    return EXIT_READY


def _recover_or_activate(command: str, params, args) -> int:
    from storage.errors import RefitError
    from tasks.activate import record_active
    from tasks.install import recover
    from tasks.installers import make_installer
    from tasks.receiver import Receiver

    rx = Receiver(params, installer=make_installer(params.installer))
    try:
        if command == "recover":
            receipt = recover(rx)
            outcome = {"status": "READY", "version": receipt.target.checkpoint.version, "detail": receipt.detail}
        else:
            with rx.store.shared(params.lock_timeout_s, "activation"):
                identity = record_active(rx.store, args.version, params.installer.kind)
            outcome = {"status": "READY", "version": identity.version, "detail": "activated"}
    except RefitError as exc:
        poisoned = rx.store.poisoned() is not None
        outcome = {"status": "POISONED" if poisoned else "FAILED", "error": str(exc)}
        print(json.dumps(outcome, sort_keys=True) if args.json else f"{outcome['status']}: {exc}")
        return EXIT_POISONED if poisoned else EXIT_FAILED
    print(json.dumps(outcome, sort_keys=True) if args.json else f"{command}: {outcome['version']} is active")
    return EXIT_READY


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

