"""A retried flow: a refit (and a publication) outlives a storage outage longer than its request retries.

The object store is moto behind the fault proxy; an outage answers every
request with the same error until it ends. Transient outages are ridden out
by retrying the whole run after a backoff; a permanent error, a poisoned
node and an interrupt are never retried.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
from tests.support.s3_support import s3, s3_lab  # noqa: F401  (s3 is a fixture)

from tests.support.lab import independent_digest
from storage.errors import PoisonedError
from storage.store.local_store import LocalStore
from tasks.installers import NoEngineInstaller


@pytest.fixture(scope="module")
def published(prefect_api, s3, tmp_path_factory):
    lab = s3_lab(tmp_path_factory.mktemp("retries"), s3, "retries")
    for kind in ("initial", "delta", "delta"):
        lab.publish(kind, storage=s3.settings())
    return lab


def quick(s3, proxy, **extra):
    """Request retries that give up in about a second: an outage of a few seconds outlasts them."""
    return s3.settings(proxy.url, retry_attempts=3, backoff_initial_s=0.1, backoff_max_s=0.3, **extra)


@contextmanager
def ends_when_logged(logger: str, text: str, proxy):
    """The proxy's outage ends as soon as ``logger`` logs a line containing ``text`` (a condition, not a timer)."""

    class Ends(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if text in record.getMessage():
                proxy.outage(None)

    handler = Ends(logging.WARNING)
    logging.getLogger(logger).addHandler(handler)
    try:
        yield
    finally:
        logging.getLogger(logger).removeHandler(handler)
        proxy.outage(None)


def test_an_outage_longer_than_request_and_stage_retries_ends_ready_after_a_flow_retry(published, s3, tmp_path):
    lab = published
    with s3.proxy() as proxy:
        proxy.outage("slowdown")  # every request: 503 SlowDown
        # it lasts until the whole run gave up on its first attempt (request retries used up) and retries
        with ends_when_logged("canonical_refit.refit", "(attempt 1 of", proxy):
            state, result = lab.refit(target="r2", cache_dir=tmp_path / "cache", storage=quick(s3, proxy),
                                      retries=5, retry_delay_s=2.0)
    assert state.name == "Ready", result.error
    assert result.target_digest == independent_digest(lab.expected("r2"))[1]
    lab.assert_checkpoint(Path(result.checkpoint_path), "r2")
    assert len(result.attempts) >= 2
    first = result.attempts[0]
    # S3's SlowDown: its message where the refused request was a GET, the bare 503 where it was a HEAD (no body)
    assert first["status"] == "FAILED" and ("Please reduce your request rate" in first["error"]
                                            or "Service Unavailable" in first["error"]), first["error"]
    assert result.attempts[-1]["status"] == "READY"
    assert any("attempt 1 failed" in note for note in result.notes)


def test_a_permanent_error_fails_at_once_in_one_attempt(published, s3, tmp_path):
    lab = published
    with s3.proxy() as proxy:
        proxy.outage("deny")  # 403 AccessDenied: retrying cannot help
        state, result = lab.refit(target="r2", cache_dir=tmp_path / "cache", storage=quick(s3, proxy),
                                  retries=5, retry_delay_s=2.0)
        requests = [(r.method, r.path) for r in proxy.requests() if "/nodes/" not in r.path]  # its record aside
    assert state.name == "Failed" and result.error_detail["type"] == "AccessDenied"
    assert len(result.attempts) == 1
    # the first read was refused and nothing was tried again (s3fs follows a refused HEAD with one listing of
    # the bucket to tell a missing object from a denied one: one read, not a retry)
    assert requests[0][0] == "HEAD" and len(requests) <= 2 and len(set(requests)) == len(requests), requests


class _BreaksMidLoad(NoEngineInstaller):
    name = "breaks-mid-load"

    def __init__(self):
        self.calls = 0

    def install(self, request):
        self.calls += 1
        raise PoisonedError("the engine died while loading (test)")


def test_a_poisoned_install_is_never_retried(flow_lab):
    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    installer = _BreaksMidLoad()
    result = lab.run(installer, retries=5, retry_delay_s=0.1)
    assert result.status == "POISONED" and len(result.attempts) == 1 and installer.calls == 1
    assert LocalStore(lab.cache, lab.model).poisoned() is not None


def test_a_stop_during_the_backoff_ends_interrupted(published, s3, tmp_path):
    from storage.runtime.cancel import StopToken

    lab = published
    stop = StopToken(interrupt=True)
    with s3.proxy() as proxy:
        proxy.outage("slowdown")
        threading.Timer(1.0, stop.stop, args=("SIGINT",)).start()
        result = lab.run(None, target="r2", cache_dir=tmp_path / "cache", storage=quick(s3, proxy), retries=5,
                         retry_delay_s=30.0, stop=stop)
    assert result.status == "INTERRUPTED" and len(result.attempts) == 1


def test_a_publication_rides_out_an_outage_and_an_identical_retry_completes_a_partial_one(published, s3, tmp_path):
    lab = published
    with s3.proxy() as proxy:
        proxy.outage("slowdown")
        with ends_when_logged("canonical_refit.retry", "(attempt 2 of", proxy):  # a whole step failed twice
            result = lab.publish("delta", storage=quick(s3, proxy), retries=4, retry_delay_s=1.0)
        refused = [r for r in proxy.requests() if r.status == 503]
    assert not result.already_published
    assert len(refused) > 3  # more than one step's request retries (3): a whole step was retried

    tensors = lab.next_step()
    record = f"/{lab.catalog.split('://', 1)[1]}/r4.json"
    with s3.proxy() as proxy:  # the payload goes up, the record write is refused: a partial publication
        proxy.faults.deny, proxy.faults.deny_methods = (record,), ("PUT",)
        with pytest.raises(Exception, match="AccessDenied|access denied"):
            lab.publish("delta", tensors, version="r4", storage=quick(s3, proxy))
        uploaded = [r for r in proxy.requests("/revisions/r4/") if r.method in ("PUT", "POST") and r.status == 200]
    assert uploaded
    retried = lab.publish("delta", tensors, version="r4", storage=s3.settings())  # the same publication again
    assert retried.version == "r4" and not retried.already_published
    state, result = lab.refit(target="r4", cache_dir=tmp_path / "cache", storage=s3.settings())
    assert state.name == "Ready", result.error
    lab.assert_checkpoint(Path(result.checkpoint_path), "r4")
