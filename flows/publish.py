"""The publisher flow: write a revision's payload and catalog record, then announce it.

    python -m flows.publish --catalog file:///tmp/catalog --model org/name \\
        --checkpoint ./step-42 --kind delta

Payload objects are written first and the catalog record last (both
create-only), so no reader ever sees a record whose payload is incomplete.
"""

from __future__ import annotations

if __name__ == "__main__":  # the CLI: --help, orphans and keygen end here, without Prefect (flows.publish_cli);
    # a publication sets the process up (which Prefect API, its environment) before Prefect is imported
    import sys

    from flows.bootstrap import bootstrap_command
    from flows.cli import exit_with
    from flows.publish_cli import quick_main

    if (_code := quick_main(sys.argv[1:])) is not None or (_code := bootstrap_command(prefer_local_server=True)):
        exit_with(_code)

import json
import logging
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import flow

from storage.catalog.records import Revision
from storage.errors import ImmutableConflict, RefitError
from storage.runtime.killpoints import killpoint
from storage.urls import join_url
from storage.catalog.kept_base import KEEP_BASES, PublisherCopy, StagedCopy
from storage.catalog.publisher import PAYLOAD_FORMATS, Payload, Snapshot, make_record, same_publication
from storage.format.tensor_source import MemoryCheckpoint
from storage.settings import PublishParams
from flows.publish_cli import PUBLISH_FLAGS, cli_error, orphans_main, parse_args, quick_main  # noqa: F401 (re-exported)
from tasks.encode_payload import ENCODE_PAYLOAD
from tasks.plan_revision import PLAN_REVISION, Publication
from tasks.publisher import Publisher, PublishResult
from tasks.upload_payload import UPLOAD_PAYLOAD
from tasks.write_record import EVENT, WRITE_RECORD, emit_published  # noqa: F401 (re-exported)
from flows.announce import announce
from flows.prefect_adapter import can_emit_events, flow_run_reporting, in_flow_run, unpersisted_results

log = logging.getLogger("canonical_refit.publish")




@flow(name="publish", flow_run_name="publish {params.model} {params.kind}", validate_parameters=True,
      persist_result=False, result_storage=unpersisted_results())
def publish(params: PublishParams) -> PublishResult:
    """Publish ``params.checkpoint`` as the launch revision, a full revision or an exact-base delta."""
    with flow_run_reporting():  # its stages are the flow run's task runs
        return run_publish(params)


def put_publication(pub: Publisher, payload: Payload | None, url: str, record: Revision) -> tuple[int, bool, int]:
    """Upload the payload, then write the record; after a transient failure, both again (bytes written,
    record created, attempts).

    Every write is create-only and a retry writes the same bytes, so a retry
    after a partial upload completes it: what is there already is accepted.
    """
    attempts = []

    def put() -> tuple[int, bool]:
        attempts.append(1)
        written = UPLOAD_PAYLOAD(pub, payload, url).bytes
        killpoint("publish.uploaded", record.version)
        created = WRITE_RECORD(pub, record)
        killpoint("publish.recorded", record.version)
        return written, created

    try:
        written, created = retried(pub.params, f"publishing {record.version}", put)
    except RefitError as exc:  # a storage error names the object; the revision it belongs to is this one
        raise exc.with_context(revision=record.version)
    return written, created, len(attempts)


def retried(params: PublishParams, what: str, fn):
    """``fn()``, called again after a transient failure under the publication's retry policy."""
    return params.publication_retry_policy().call(what, fn)


def run_publish(params: PublishParams, *, source: MemoryCheckpoint | None = None,
                keep_base: str = "disk") -> PublishResult:
    """The publication runbook (the flow's body; runs plain outside a flow run): plan, encode, upload, record.

    ``source`` publishes tensors in memory instead of ``params.checkpoint``
    (same stages, same bytes; nothing but the payload is staged on disk);
    ``keep_base`` says where the publisher keeps the next delta's base:
    ``disk`` (``params.state_dir``) or ``memory`` (this process).
    """
    if keep_base not in KEEP_BASES:
        raise ValueError(f"keep_base must be one of {', '.join(KEEP_BASES)}, not {keep_base!r}")
    if params.world_size is not None or params.rank is not None:  # one rank's part of a revision (flows/sharded.py)
        from flows.sharded import run_publish_part

        return run_publish_part(params, source=source, keep_base=keep_base)
    with _turn(params):
        prepared = _prepare(Publisher(params), source, keep_base, time.perf_counter(), stage_copy=False)
        return _complete(prepared)


class PendingPublish:
    """A publication whose checkpoint was read and encoded, still uploading (``start_publish``).

    ``version`` and ``sequence`` are its revision's; ``result()`` waits for
    the upload and the record and returns the ``PublishResult`` (or raises the
    typed error that ended it); ``done()`` says whether it has ended.
    ``blocked_s`` is how long the caller waited for it to be returned.
    """

    def __init__(self, version: str, sequence: int, future: Future, blocked_s: float):
        self.version, self.sequence, self.blocked_s = version, sequence, blocked_s
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> PublishResult:
        """The ``PublishResult`` once the record is written; raises its typed error, or ``TimeoutError``."""
        return self._future.result(timeout)

    def __repr__(self) -> str:
        state = "done" if self.done() else "uploading"
        return f"<PendingPublish {self.version} (seq {self.sequence}) {state}>"


def start_publish(params: PublishParams, *, source: MemoryCheckpoint | None = None,
                  keep_base: str = "disk") -> PendingPublish:
    """``run_publish`` that returns once the checkpoint was read: planned, encoded, and the next delta's base
    copied, so the caller may change its tensors or folder; the upload and the record go on in a thread.

    Publications of one catalog and model in this process go one at a time:
    the next one (either way) first waits for this one to end. If it fails,
    nothing refers to its payload and the kept base is still its base, so
    the next publication is planned as if it had never started. The thread
    is not a daemon: a process that ends normally finishes the upload first.
    """
    if keep_base not in KEEP_BASES:
        raise ValueError(f"keep_base must be one of {', '.join(KEEP_BASES)}, not {keep_base!r}")
    if params.world_size is not None or params.rank is not None:
        raise ValueError("a rank's part of a sharded publication is published with wait=True")
    if in_flow_run():
        raise ValueError("wait=False publishes outside a Prefect flow run (inside one, stages are its task runs)")
    started = time.perf_counter()
    turn = _turn(params)
    turn.acquire()
    try:
        prepared = _prepare(Publisher(params), source, keep_base, started, stage_copy=True)
    except BaseException:
        turn.release()
        raise

    def finish() -> PublishResult:
        try:
            return _complete(prepared)
        finally:
            turn.release()

    future = _uploads().submit(finish)
    return PendingPublish(prepared.plan.version, prepared.plan.sequence, future,
                          round(time.perf_counter() - started, 4))


_TURNS: dict[tuple[str, str], threading.Lock] = {}
_TURNS_LOCK = threading.Lock()
_UPLOADS: list[ThreadPoolExecutor] = []  # made by the first start_publish, not at import


def _uploads() -> ThreadPoolExecutor:
    """The pool that finishes ``start_publish``'s uploads; joined when the interpreter exits (concurrent.futures
    does), so a pending upload is finished, not dropped."""
    with _TURNS_LOCK:
        if not _UPLOADS:
            _UPLOADS.append(ThreadPoolExecutor(max_workers=4, thread_name_prefix="publish-upload"))
        return _UPLOADS[0]


def _turn(params: PublishParams) -> threading.Lock:
    """The lock one publication of a catalog and model holds from its plan to its record (released by the
    thread that ends it)."""
    with _TURNS_LOCK:
        return _TURNS.setdefault((params.catalog, params.model), threading.Lock())


@dataclass
class _Prepared:
    """What a publication has once its checkpoint was read: the payload staged, the record to write."""

    pub: Publisher
    plan: Publication
    payload: Payload | None
    snap: Snapshot
    record: Revision
    tmp: tempfile.TemporaryDirectory
    started: float
    keep_base: str
    staged: StagedCopy | None = None


def _prepare(pub: Publisher, source: MemoryCheckpoint | None, keep_base: str, started: float, *,
             stage_copy: bool) -> _Prepared:
    """Plan and encode (the stages that read the checkpoint); with ``stage_copy`` also copy the next base."""
    params, objects, catalog = pub.params, pub.objects, pub.catalog
    tmp = None
    try:
        # the catalog's prefix first: with one bucket for both, the probe is always under {catalog}/ (the one
        # prefix a least-privilege policy lets the publisher delete in); a payload bucket of its own is probed too
        for prefix in dict.fromkeys([catalog.url, pub.payload_root]):
            retried(params, "checking create-only writes", lambda p=prefix: objects.ensure_conditional_writes(
                p, allow_unconditional=params.allow_unconditional_writes))
        plan = PLAN_REVISION(pub, source, keep_base)
        tmp = tempfile.TemporaryDirectory(prefix="canonical-refit-publish-")
        payload, snap = ENCODE_PAYLOAD(pub, plan, Path(tmp.name) / plan.version)
        uri = join_url(join_url(pub.payload_root, plan.version), payload.index_name) if payload else None
        record = make_record(params.model, plan.version, plan.sequence, PAYLOAD_FORMATS[params.kind],
                             snap.checksum_format, snap.format_digest, snap.target_digest, base=plan.base, uri=uri)
        if plan.existing is not None and not same_publication(plan.existing, record):
            raise ImmutableConflict("a different revision is already published under this version",
                                    revision=plan.version, file=catalog.record_url(plan.version))
        prepared = _Prepared(pub, plan, payload, snap, record, tmp, started, keep_base)
        if stage_copy and params.keep_copy:
            prepared.staged = PublisherCopy(params.state_dir, params.model, keep_base=keep_base).stage(
                plan.target, record.version, snap.checksum_format, snap.checksums, workers=params.workers)
        return prepared
    except BaseException:
        if tmp is not None:
            tmp.cleanup()
        pub.close()
        raise


def _complete(prepared: _Prepared) -> PublishResult:
    """Upload the payload, write the record, announce it, keep the next base; the result."""
    try:
        result = _upload_and_record(prepared)
    finally:
        prepared.pub.close()
    log.info("published %s (seq %d, %s): %d bytes written, %d changed tensor(s), ratio %.2f, %.2fs (%.0f MB/s "
             "of model)", result.version, result.sequence, result.payload_format, result.bytes_written,
             result.changed_tensors, result.compression_ratio, result.seconds, result.bytes_per_s / 1e6)
    return result


def _upload_and_record(prepared: _Prepared) -> PublishResult:
    pub, plan, payload, record = prepared.pub, prepared.plan, prepared.payload, prepared.record
    params, catalog = pub.params, pub.catalog
    try:
        url = join_url(pub.payload_root, plan.version)
        try:
            written, created, attempts = put_publication(pub, payload, url, record)
        except ImmutableConflict as exc:
            if payload is None or not (exc.file or "").startswith(url + "/") or plan.existing is not None:
                raise
            # objects of a publication that never wrote its record (a crashed publisher) hold this prefix: they
            # are never referenced, so this publication's payload goes beside them, under a prefix of its own
            fresh = join_url(pub.payload_root, f"{plan.version}.{pub.publication[:12]}")
            log.warning("%s holds objects of a publication of %s that never wrote its record; publishing under "
                        "%s instead (the orphaned objects are reclaimable: docs/object-storage.md)", url,
                        plan.version, fresh)
            url = fresh
            record = Revision.model_validate(record.to_json() | {"uri": join_url(fresh, payload.index_name)})
            written, created, attempts = put_publication(pub, payload, url, record)
    except BaseException:
        if prepared.staged is not None:
            prepared.staged.discard()
        raise
    finally:
        prepared.tmp.cleanup()
    if prepared.staged is not None:
        prepared.staged.commit()  # the record is written: this copy is the next delta's exact base
    delivery = None
    if params.emit_event:
        if can_emit_events():
            delivery = announce(record, catalog, budget_s=params.event_delivery_s)
        else:  # a trainer process without Prefect: nothing to announce to (nodes still find it by polling)
            log.info("no Prefect API configured: %s was published without the %s event", record.version, EVENT)
    if prepared.staged is None and params.keep_copy:
        PublisherCopy(params.state_dir, params.model, keep_base=prepared.keep_base).keep(
            plan.target, record.version, prepared.snap.checksum_format, prepared.snap.checksums,
            workers=params.workers)
    seconds = time.perf_counter() - prepared.started
    return PublishResult(
        version=record.version, sequence=record.sequence, payload_format=record.payload_format,
        record_url=catalog.record_url(record.version), uri=record.uri, target_digest=record.target_digest,
        encoding=payload.encoding if payload else None, bytes_written=written,
        decoded_bytes=payload.decoded_bytes if payload else 0,
        encoded_bytes=payload.encoded_bytes if payload else 0,
        compression_ratio=round(payload.compression_ratio, 3) if payload else 0.0,
        changed_tensors=len(payload.changed) if payload else 0, files=len(payload.files) if payload else 0,
        seconds=round(seconds, 3), model_bytes=plan.target.nbytes,
        bytes_per_s=round(plan.target.nbytes / seconds, 1) if seconds > 0 else 0.0,
        already_published=not created, attempts=attempts,
        stages=[r.summary() for r in pub.ledger.stages.values()],
        event_delivered=delivery.delivered if delivery else None, event_error=delivery.error if delivery else None,
    )


def main(argv: list[str] | None = None) -> int:
    from flows.prefect_api import prefect_api

    from flows.report import quiet_expected_errors

    argv = list(sys.argv[1:] if argv is None else argv)
    if (code := quick_main(argv)) is not None:  # orphans, keygen
        return code
    quiet_expected_errors()
    params, as_json = parse_args(argv)
    with prefect_api():
        state = publish(params, return_state=True)
    value = state.result(raise_on_failure=False)
    if isinstance(value, PublishResult):
        print(json.dumps(asdict(value), sort_keys=True) if as_json else  # text: only what there is
              "\n".join(f"{k}: {v}" for k, v in asdict(value).items() if v is not None))
        return 0
    message = cli_error(value) if isinstance(value, RefitError) else f"{state.name}: {state.message}"
    print(json.dumps({"error": message}) if as_json else f"error: {message}")
    return 1


if __name__ == "__main__":
    from flows.cli import exit_with

    exit_with(main())
