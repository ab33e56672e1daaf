"""The publisher's command line, without Prefect: its flags, ``--help``, ``orphans`` and ``keygen``.

``python -m flows.publish`` parses its flags here; the commands that run no
flow (``--help``, ``orphans``, ``keygen``) end here too, before anything
imports Prefect (``quick_main``). A publication itself runs the ``publish``
flow: ``flows.publish.main``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace

from flows.options import add_flags, build, error_as_flags, flags, given, parse
from storage.errors import RefitError
from storage.settings import PublishParams
from storage.urls import join_url, parent_url


PUBLISH_FLAGS = flags(PublishParams)  # every field of a publication (storage: as PublishParams.storage names them)
ORPHANS_FLAGS = [replace(f, required=f.path in ("catalog", "model"))
                 for f in flags(PublishParams, "catalog", "model", "payload_url", "storage.endpoint_url")]


def _publish_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flows.publish", description=(
        "Publish a local safetensors checkpoint as a canonical revision: the launch revision (metadata "
        "only), a full checkpoint, or an XOR delta against the exact previous revision."))
    add_flags(parser, PublishParams, PUBLISH_FLAGS)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return parser


def parse_args(argv: list[str]) -> tuple[PublishParams, bool]:
    """PublishParams from the flags given (the environment fills in the rest), and whether --json was."""
    params, args = parse(_publish_parser(), PublishParams, PUBLISH_FLAGS, argv)
    return params, args.json


def cli_error(exc: RefitError) -> str:
    """A publication's error for the command line: the fields it names (``kind="full"``) as flags."""
    return error_as_flags(exc, PUBLISH_FLAGS)


def orphans_main(argv: list[str]) -> int:
    """``python -m flows.publish orphans``: list (or ``--delete``) payloads no record references."""
    parser = argparse.ArgumentParser(prog="python -m flows.publish orphans", description=(
        "List the payload folders no catalog record references (left by publishers that crashed before their "
        "record) and older than a grace period; --delete reclaims them."))
    add_flags(parser, PublishParams, ORPHANS_FLAGS)
    parser.add_argument("--older-than-hours", type=float, default=24.0,
                        help="only folders whose newest object is at least this old (default 24: a publication "
                             "in progress is never counted)")
    parser.add_argument("--delete", action="store_true", help="delete the orphaned folders")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    from storage.catalog.orphans import find_orphans  # the catalog and object-store stack: not for --help
    from storage.catalog.records import Catalog
    from storage.objects.store import ObjectStore
    from storage.settings import ObjectStoreSettings

    values = given(args, ORPHANS_FLAGS)
    storage = build(ObjectStoreSettings, values.get("storage", {}))
    objects = ObjectStore.shared(storage)
    catalog = Catalog(objects, values["catalog"], values["model"])
    root = values.get("payload_url") or join_url(parent_url(catalog.url), "revisions")
    try:
        found = find_orphans(objects, catalog, root, older_than_s=args.older_than_hours * 3600)
        for orphan in found if args.delete else ():
            objects.delete_tree(orphan.url)
    except RefitError as exc:
        print(json.dumps({"error": str(exc)}) if args.json else f"error: {exc}")
        return 1
    if args.json:
        print(json.dumps({"orphans": [asdict(o) for o in found], "deleted": args.delete}, sort_keys=True))
    else:
        for orphan in found:
            print(f"{'deleted' if args.delete else 'orphan'}: {orphan.url} ({orphan.objects} objects, "
                  f"{orphan.bytes:,} bytes, newest {orphan.age_s / 3600:.1f} h old)")
        print(f"{len(found)} orphaned payload folder(s) under {root}" + (", deleted" if args.delete and found else ""))
    return 0


def quick_main(argv: list[str]) -> int | None:
    """The exit code of a command that runs no flow (``orphans``, ``keygen``), or None for a publication;
    ``--help`` prints the help and exits here (as does a usage error with it)."""
    if argv[:1] == ["orphans"]:
        return orphans_main(argv[1:])
    if argv[:1] == ["keygen"]:
        from storage.catalog.signing import keygen_main

        return keygen_main(argv[1:])
    if "-h" in argv or "--help" in argv:
        parse_args(argv)  # argparse prints the help and exits
    return None
