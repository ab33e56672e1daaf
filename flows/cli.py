"""Command line of the receiver: ``python -m flows.refit [status|recover|activate] ...``.

Exit codes: 0 ready (or skipped: nothing to do), 1 failed (the installed
version is unchanged), 2 usage error, 3 poisoned (run ``recover``), 130
interrupted (Ctrl-C, SIGTERM or cancellation; the next run recovers the store).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from flows.options import add_flags, build, field_errors, flags, given, with_values
from flows.report import FAILED, INTERRUPTED, READY, RefitResult, print_result, quiet_expected_errors, result_of

_COMMANDS = ("status", "recover", "activate")
EXIT_CODES_HELP = "Exit codes: 0 ready or skipped, 1 failed, 2 usage, 3 poisoned, 130 interrupted."
def _refit_flags() -> list:
    """Every field of RefitParams but the rollback policy (a node's agent pins that: deployments/serve.py)."""
    from storage.settings import RefitParams

    return flags(RefitParams, exclude={"rollbacks"})


def _recover_flags() -> list:
    from storage.settings import RecoverParams

    return flags(RecoverParams)


REFIT_FLAGS = _refit_flags()
RECOVER_FLAGS = _recover_flags()
STATUS_FLAGS = [f for f in RECOVER_FLAGS if f.path in ("model", "cache_dir", "lock_timeout_s")]
ACTIVATE_FLAGS = STATUS_FLAGS + [f for f in RECOVER_FLAGS if f.path == "installer.kind"]


def _run_parser() -> argparse.ArgumentParser:
    from storage.settings import RefitParams

    parser = argparse.ArgumentParser(
        prog="python -m flows.refit",
        description="Move the local checkpoint to a target revision, verify it and install it. With no "
                    "arguments at all, runs the embedded demo. Subcommands: status, recover, activate "
                    f"(see `python -m flows.refit recover --help`). {EXIT_CODES_HELP}")
    add_flags(parser, RefitParams, REFIT_FLAGS)
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return parser


def _sub_parser(command: str) -> argparse.ArgumentParser:
    from storage.settings import RecoverParams

    helps = {
        "status": "print the store state and the installed identity",
        "recover": "repair the store and, if the node is poisoned, re-install the last verified checkpoint "
                   "through the installer it was poisoned with, then clear the mark",
        "activate": "record a checkpoint installed with --no-activate as the active version",
    }
    parser = argparse.ArgumentParser(prog=f"python -m flows.refit {command}", description=helps[command])
    add_flags(parser, RecoverParams, RECOVER_FLAGS if command == "recover" else ACTIVATE_FLAGS)
    if command != "recover":  # recover's own --catalog and --node say where the node's record is rewritten
        parser.add_argument("--catalog", help="not needed here (accepted so a refit's flags can be reused)")
    if command == "activate":
        parser.add_argument("--version", required=True, help="the installed version to activate")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return parser


def build_params(args: argparse.Namespace):
    """RefitParams from the flags that were given; the environment fills in the rest."""
    from storage.settings import RefitParams

    return build(RefitParams, given(args, REFIT_FLAGS))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_expected_errors()
    if not argv:  # the demo: flow runs, through a Prefect API
        from flows.bootstrap import bootstrap_command
        from flows.prefect_api import prefect_api
        from flows.demo import run_demo

        if (code := bootstrap_command(prefer_local_server=True)) is not None:
            return code
        with prefect_api():
            return run_demo()
    from pydantic import ValidationError

    command = argv[0] if argv[0] in _COMMANDS else None
    parser = _sub_parser(command) if command else _run_parser()
    args = parser.parse_args(with_values(argv[1:] if command else argv,
                                         REFIT_FLAGS if command is None else RECOVER_FLAGS))
    try:
        if command == "status":
            return _status(args)
        if command == "recover":
            return _recover(args)
        if command == "activate":
            return _activate(args)
        params = build_params(args)
    except ValidationError as exc:
        parser.error(field_errors(exc, REFIT_FLAGS if command is None else RECOVER_FLAGS))
    from flows.bootstrap import bootstrap_command

    # a refit runs a flow: set the process up (status, recover, activate and --help never get here)
    if (code := bootstrap_command(prefer_local_server=True)) is not None:
        return code
    result = run_cli_refit(params)
    if args.json:
        print(json.dumps(result.to_json(), sort_keys=True), flush=True)
    else:
        print_result(result, REFIT_FLAGS)  # the error's fields as this command's flags
        sys.stdout.flush()
    if not abandoned():
        from storage.store.flush import wait_for_flushes

        wait_for_flushes()  # reported already; a one-off command still leaves its checkpoint on disk
    return result.exit_code


REPORT_GRACE_S = 15.0  # after the run's own work is done, how long Prefect may take to record it
_abandoned: list[bool] = []


def run_cli_refit(params) -> RefitResult:
    """Run the refit flow for the CLI; its outcome never depends on the API after the work is done.

    The flow runs in a worker thread while this (main) thread owns the
    signals: Ctrl-C or SIGTERM stop the run cooperatively. Once the run's own
    work has ended (its result is known), Prefect gets ``REPORT_GRACE_S`` to
    record the final state; if its API is gone, the CLI reports the run's real
    outcome anyway and exits without waiting on it.
    """
    import contextvars
    import threading
    import time

    from flows.prefect_api import prefect_api
    from flows.refit import refit
    from flows.report import watching
    from storage.runtime.cancel import signals_stop_the_run

    outcome: dict = {}
    finished = threading.Event()

    def body() -> None:
        from prefect import tags

        from flows.run_labels import node_tag

        try:
            with tags(node_tag(params.node)):  # a one-off run is labelled with its node, as the agent's are
                outcome["state"] = refit(params, return_state=True)
        except BaseException as exc:  # reported below from what the run itself recorded
            outcome["error"] = exc
        finally:
            finished.set()

    with signals_stop_the_run():
        with prefect_api() as api, watching() as watch:
            context = contextvars.copy_context()  # the flow thread sees this API's settings, and the watch
            thread = threading.Thread(target=context.run, args=(body,), name="refit-flow", daemon=True)
            thread.start()
            ended_at = None
            while not finished.wait(0.1):
                if watch.outcome is None:
                    continue
                ended_at = ended_at or time.monotonic()
                if time.monotonic() - ended_at > REPORT_GRACE_S:
                    _abandoned.append(True)
                    api.drain_timeout_s = 2.0
                    logging.getLogger("canonical_refit.cli").warning(
                        "the refit ended but Prefect could not record its final state within %.0fs; "
                        "reporting the outcome without it", REPORT_GRACE_S)
                    break
    if watch.outcome is not None:  # the run's own outcome, whatever Prefect made of it
        return watch.outcome
    if "state" in outcome:
        return result_of(outcome["state"])
    exc = outcome.get("error")
    status = INTERRUPTED if isinstance(exc, KeyboardInterrupt) else FAILED
    return RefitResult(status, None, None, None, None, error=f"{type(exc).__name__}: {exc}" if exc else status,
                       target=params.target)


def abandoned() -> bool:
    """True if a flow thread was left behind (the process must exit without waiting for it)."""
    return bool(_abandoned)


def _status(args) -> int:
    from storage.settings import RecoverParams
    from storage.store.local_store import LocalStore

    params = build(RecoverParams, given(args, STATUS_FLAGS))
    store = LocalStore(params.cache_dir, params.model, create=False)
    if not store.exists:
        print(f"no store for {params.model} under {params.cache_dir}: nothing was refitted there yet "
              "(check --model and --cache-dir)", file=sys.stderr)
        return 1
    from storage.errors import RefitError

    try:
        described = store.describe()
    except RefitError as exc:  # a state file that is not what it should be: named, with what to do
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(described, indent=None if args.json else 2, sort_keys=True, default=str))
    return 0


def _recover(args) -> int:
    from flows.recover import run_recover
    from storage.settings import RecoverParams

    result = run_recover(build(RecoverParams, given(args, RECOVER_FLAGS)))
    if args.json:
        print(json.dumps(result.to_json(), sort_keys=True))
    elif result.status == READY:
        for repair in result.repairs:
            print(f"repaired: {repair}")
        print(f"recover: {result.detail}")
    else:
        from flows.options import as_flags

        print(f"{result.status}: {as_flags(result.error or '', RECOVER_FLAGS)}")
    return result.exit_code


def _activate(args) -> int:
    from storage.settings import RecoverParams
    from storage.errors import RefitError
    from storage.store.local_store import LocalStore

    params = build(RecoverParams, given(args, STATUS_FLAGS))
    store = LocalStore(params.cache_dir, params.model, create=False)
    try:
        with store.shared(params.lock_timeout_s, "activation"):
            identity = store.activate(args.version, getattr(args, "installer__kind", None) or "none")
    except RefitError as exc:
        print(json.dumps({"status": FAILED, "error": str(exc)}) if args.json else f"FAILED: {exc}")
        return 1
    outcome = {"status": READY, "version": identity.version, "detail": "activated"}
    print(json.dumps(outcome, sort_keys=True) if args.json else f"activate: {identity.version} is active")
    return 0


def exit_with(code: int) -> None:
    """Exit with ``code`` once the output is flushed, without the interpreter's teardown.

    By now the result is printed, the run's logs and events were drained to
    the API and the checkpoint's write-back has finished (or a flow thread
    was abandoned to a dead API): what is left is Prefect's exit handlers
    and module teardown, about a second of a one-off command's time.
    """
    import logging

    for handler in logging.getLogger().handlers + logging.getLogger("prefect").handlers:
        try:
            handler.flush()
        except Exception:  # a handler that cannot flush has nothing the user still needs
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    exit_with(main())
