"""The publisher's command line, without Prefect: its flags, ``--help``, ``orphans`` and ``keygen``.

``python -m flows.publish`` parses its flags here; the commands that run no
flow (``--help``, ``orphans``, ``keygen``) end here too, before anything
imports Prefect (``quick_main``). A publication itself runs the ``publish``
flow: ``flows.publish.main``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from flows.options import Flag, add_flags, build, given
from storage.catalog.records import Catalog
from storage.errors import RefitError
from storage.settings import PublishParams
from storage.urls import join_url, parent_url


PUBLISH_FLAGS = [
    Flag("catalog"), Flag("model"), Flag("checkpoint"), Flag("kind"), Flag("version"), Flag("payload_url"),
    Flag("base_version"), Flag("base_checkpoint"), Flag("state_dir"), Flag("keep_copy", invert=True),
    Flag("encoding"), Flag("checksum_format"), Flag("bucket_max_mib", "--bucket-mib"), Flag("zstd_level"),
    Flag("workers"), Flag("allow_unconditional_writes"), Flag("emit_event", "--no-event", invert=True),
    Flag("event_delivery_s", "--event-delivery-seconds"),
    Flag("retries"), Flag("retry_delay_s", "--retry-delay"), Flag("stage_retries"),
    Flag("stage_retry_delay_s", "--stage-retry-delay"), Flag("storage.concurrency", "--upload-workers"),
    Flag("storage.endpoint_url", "--s3-endpoint-url"), Flag("rank"), Flag("world_size"), Flag("publication"),
    Flag("part_timeout_s", "--part-timeout"), Flag("signing_key"),
]


def parse_args(argv: list[str]) -> tuple[PublishParams, bool]:
    """PublishParams from the flags given (the environment fills in the rest), and whether --json was."""
    from pydantic import ValidationError

    parser = argparse.ArgumentParser(prog="python -m flows.publish", description=(
        "Publish a local safetensors checkpoint as a canonical revision: the launch revision (metadata "
        "only), a full checkpoint, or an XOR delta against the exact previous revision."))
    add_flags(parser, PublishParams, PUBLISH_FLAGS)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    try:
        return build(PublishParams, given(args, PUBLISH_FLAGS)), args.json
    except ValidationError as exc:
        parser.error("; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors()))


def orphans_main(argv: list[str]) -> int:
    """``python -m flows.publish orphans``: list (or ``--delete``) payloads no record references."""
    from storage.catalog.orphans import find_orphans
    from storage.objects.store import ObjectStore
    from storage.settings import ObjectStoreSettings

    parser = argparse.ArgumentParser(prog="python -m flows.publish orphans", description=(
        "List the payload folders no catalog record references (left by publishers that crashed before their "
        "record) and older than a grace period; --delete reclaims them."))
    parser.add_argument("--catalog", required=True, help="catalog URL: s3://bucket/prefix, file:///path")
    parser.add_argument("--model", required=True, help="model id, e.g. org/name")
    parser.add_argument("--payload-url", help="where payloads go (default: revisions/ beside the catalog)")
    parser.add_argument("--older-than-hours", type=float, default=24.0,
                        help="only folders whose newest object is at least this old (default 24: a publication "
                             "in progress is never counted)")
    parser.add_argument("--delete", action="store_true", help="delete the orphaned folders")
    parser.add_argument("--s3-endpoint-url", help="S3 endpoint (default: the AWS environment)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    storage = ObjectStoreSettings(**({"endpoint_url": args.s3_endpoint_url} if args.s3_endpoint_url else {}))
    objects = ObjectStore.shared(storage)
    catalog = Catalog(objects, args.catalog, args.model)
    root = args.payload_url or join_url(parent_url(catalog.url), "revisions")
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
