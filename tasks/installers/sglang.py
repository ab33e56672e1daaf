"""Installers for SGLang 0.5.23 (docs/sglang.md).

``sglang`` drives the in-engine loader (``tasks.installers.sglang_loader``): it writes the
install request into the store, calls ``POST /update_weights_from_tensor`` with
``load_format`` = the loader's import path and one empty tensor list per TP
rank, reads every rank's report, then sets and confirms ``weight_version``. The
engine's configured model path and load format never change.

``sglang-disk`` is for stock SGLang: it switches the stable path
``{store}/current`` (a symlink) to the prepared checkpoint and calls
``POST /update_weights_from_disk`` on it, so an engine launched on that path
keeps the same configured path across refits.

Either raises ``InstallError`` when no engine's weights were touched (engine
unreachable, request rejected, loader set-up failed: the old version stays
active) and ``PoisonedError`` when any engine's weights may have changed
without the install completing everywhere. Engines install in parallel; the
install succeeds only when every engine did.
"""

from __future__ import annotations

import base64
import logging
import os
import pickle
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, TypeVar
from urllib.parse import urlsplit

import httpx

from storage.durable import fsync_dir
from storage.errors import InstallError, PoisonedError
from storage.store.local_store import ActiveIdentity, LocalStore, now_ms
from storage.store.locks import StoreLock
from storage.settings import InstallerSettings
from tasks.installers.base import EngineReport, InstallOutcome, InstallRequest, confirmed

log = logging.getLogger("canonical_refit.install")
T = TypeVar("T")
OK, UNTOUCHED, POISONED = "ok", "untouched", "poisoned"
# One pickled empty list per TP rank: the in-engine loader takes its weights from the store.
EMPTY_TENSOR_LIST = base64.b64encode(pickle.dumps([])).decode("ascii")
# update_weights_from_disk failures SGLang reports before it touches weights (notes, section 2b, steps 5-6)
_DISK_SETUP_FAILURES = ("Failed to get model loader", "Failed to get weights iterator")
SETTLE_MAX_S = 30.0
OBSERVE_TIMEOUT_S = 10.0


# -- HTTP ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """One engine's answer to one request, or why there is none."""

    url: str
    sent: bool  # the whole request reached the engine: it may have acted on it
    status: int | None = None  # None: no answer (timeout, connection dropped)
    body: object = None  # parsed JSON, None if the body was not JSON
    error: str | None = None

    @property
    def succeeded(self) -> bool:
        return self.status == 200 and isinstance(self.body, dict) and self.body.get("success") is True

    def describe(self) -> str:
        if self.status is None:
            return f"{self.url}: {self.error}"
        message = self.body.get("message") if isinstance(self.body, dict) else None
        return f"{self.url}: HTTP {self.status} {message if message is not None else (self.error or self.body)!s}"


class EngineClient:
    """JSON over HTTP (httpx) to one SGLang server, telling apart 'not sent' from 'sent, no answer'.

    Each request gets a fresh connection (no keep-alive): a pooled
    connection the engine closed meanwhile fails only once the request is
    written, which would look like "sent, no answer" and poison the node.
    """

    def __init__(self, url: str, timeout_s: float, api_key: str | None = None):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InstallError(f"engine URL {url!r} is not http(s)://host[:port]", field="engine_urls")
        self.url = url.rstrip("/")
        self._timeout_s = timeout_s
        headers = {"Accept": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s, trust_env=False,
                                  limits=httpx.Limits(max_keepalive_connections=0))

    def call(self, method: str, path: str, body: dict | None = None) -> Reply:
        """Send one request; never raises."""
        try:
            response = self._http.request(method, path, json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.WriteError, httpx.WriteTimeout,
                httpx.LocalProtocolError) as exc:  # refused, unreachable, or cut short: nothing to act on
            return Reply(self.url, False, error=f"could not send {method} {path}: {exc}")
        except httpx.HTTPError as exc:  # written, then no (whole) answer: the engine may have acted on it
            reason = "timed out" if isinstance(exc, httpx.TimeoutException) else \
                f"dropped ({type(exc).__name__}: {exc})"
            return Reply(self.url, True, error=f"{method} {path} was sent but {reason} after "
                                               f"{self._timeout_s:g}s at most")
        try:
            return Reply(self.url, True, response.status_code, response.json())
        except ValueError:
            return Reply(self.url, True, response.status_code,
                         error=f"answered a body that is not JSON: {response.content[:120]!r}")

    def get_json(self, path: str, *, revision: str | None = None) -> dict:
        """A read-only GET that must answer a JSON object; anything else is an ``InstallError``."""
        reply = self.call("GET", path)
        if reply.status != 200 or not isinstance(reply.body, dict):
            raise InstallError(f"engine {reply.describe()} (GET {path})", revision=revision)
        return reply.body


def each(items: Sequence[T], fn: Callable[[T], object]) -> list:
    """``fn`` over ``items`` in parallel (one thread per engine); re-raises the first error once all are done."""
    if len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=len(items), thread_name_prefix="engine") as pool:
        futures = [pool.submit(fn, item) for item in items]
    return [future.result() for future in futures]


# -- what both installers share -----------------------------------------------------------------------------


class _SGLangBase:
    name = "sglang"

    def __init__(self, settings: InstallerSettings):
        self.settings = settings
        self.engine_urls = tuple(settings.engine_urls)
        self.engines = [EngineClient(url, settings.timeout_s, settings.api_key) for url in settings.engine_urls]
        # reading what an engine runs must be quick (a heartbeat asks every half minute); installs may take long
        self._readers = [EngineClient(url, min(OBSERVE_TIMEOUT_S, settings.timeout_s), settings.api_key)
                         for url in settings.engine_urls]

    def observe(self) -> tuple[EngineReport, ...]:
        """What each engine says it runs: the ``weight_version`` and ``model_path`` of ``GET /model_info``."""

        def ask(engine: EngineClient) -> EngineReport:
            reply = engine.call("GET", "/model_info")
            if reply.status == 200 and isinstance(reply.body, dict):
                return EngineReport(engine.url, reply.body.get("weight_version"), str(reply.body.get("model_path")))
            return EngineReport(engine.url, None, f"no answer ({reply.describe()})")

        return tuple(each(self._readers, ask))

    def is_current(self, identity: ActiveIdentity) -> bool:
        """True if every engine reports ``weight_version`` = the installed version."""
        return confirmed(self.observe(), identity.version)

    def _install_lock(self, store: LocalStore) -> StoreLock:
        """Serializes installers of one store (two receivers must not swap each other's request)."""
        return StoreLock(store.root / "install" / "lock", exclusive=True, timeout_s=self.settings.timeout_s,
                         what="engine install")

    def _confirm_versions(self, request: InstallRequest) -> list[dict]:
        """Every engine reports ``weight_version`` = the new version (set it where needed), or poisoned."""

        def confirm(engine: EngineClient) -> dict:
            info = engine.get_json("/model_info", revision=request.version)
            if info.get("weight_version") != request.version:
                reply = engine.call("POST", "/update_weight_version",
                                    {"new_version": request.version, "abort_all_requests": False})
                if not reply.succeeded:
                    raise InstallError(f"setting weight_version failed: {reply.describe()}")
                info = engine.get_json("/model_info", revision=request.version)
            if info.get("weight_version") != request.version:
                raise InstallError(f"engine {engine.url} reports weight_version {info.get('weight_version')!r}")
            return info

        try:
            return each(self.engines, confirm)
        except InstallError as exc:
            raise PoisonedError(f"the engines loaded {request.version} but its weight_version could not be "
                                f"confirmed: {exc.reason}", revision=request.version, file=str(request.path)) from exc

    def _server_infos(self, request: InstallRequest) -> list[dict]:
        return each(self.engines, lambda e: e.get_json("/server_info", revision=request.version))


# -- sglang: through the in-engine loader ----------------------------------------------------------------------


class SGLangInstaller(_SGLangBase):
    """Loads the prepared checkpoint with the in-engine loader registered as SGLang's custom weight loader."""

    name = "sglang"

    def install(self, request: InstallRequest) -> InstallOutcome:
        from tasks.installers.sglang_loader import LoadRequest, read_reports, write_request

        store, started = request.store, time.perf_counter()
        ranks = [self._ranks(engine, info, request) for engine, info in zip(self.engines, self._server_infos(request))]
        expected = sum(calls for _, calls in ranks)
        load_request = LoadRequest(
            request_id=uuid.uuid4().hex, model=store.model, version=request.version, digest=request.digest,
            format_digest=request.format_digest, path=store.relative(request.path), files=request.files,
            installer=self.name, created_at_unix_ms=now_ms(),
            deadline_unix_ms=now_ms() + int(self.settings.timeout_s * 1000))
        with self._install_lock(store):
            try:
                write_request(store, load_request)
            except OSError as exc:
                raise InstallError(f"cannot write the install request: {exc}", revision=request.version,
                                   file=str(store.root / "install")) from exc
            replies = each(list(zip(self.engines, ranks)), self._update)
            reports = self._settle(lambda: read_reports(store, load_request.request_id), replies, expected)
        verdict, explanation = judge_loader_install(replies, reports, expected)
        where = {"revision": request.version, "file": str(request.path)}
        if verdict == UNTOUCHED:
            raise InstallError(f"no engine's weights were touched: {explanation}", **where)
        if verdict == POISONED:
            raise PoisonedError(f"the engines' weights may be partially written: {explanation}", **where)
        self._confirm_versions(request)
        loaded = max(reports, key=lambda r: r.tensors)
        detail = (f"{request.version} loaded by {self.settings.custom_loader} into {len(self.engines)} engine(s), "
                  f"{len(reports)} rank(s), {loaded.tensors} tensors ({loaded.bytes:,} bytes) each, in "
                  f"{time.perf_counter() - started:.2f}s; weight_version {request.version} confirmed")
        log.info(detail)
        return InstallOutcome(detail, tuple(e.url for e in self.engines))

    def _update(self, engine_ranks: tuple[EngineClient, tuple[int, int]]) -> Reply:
        """``POST /update_weights_from_tensor``: no weight_version (set only once every rank reported success)."""
        engine, (tp_size, _) = engine_ranks
        return engine.call("POST", "/update_weights_from_tensor", {
            "serialized_named_tensors": [EMPTY_TENSOR_LIST] * tp_size, "load_format": self.settings.custom_loader,
            "flush_cache": True, "abort_all_requests": False, "selector": "target"})

    def _ranks(self, engine: EngineClient, info: dict, request: InstallRequest) -> tuple[int, int]:
        """(TP size, loader calls to expect) of one engine; refuses engines without the loader registered."""
        loaders = info.get("custom_weight_loader") or []
        if self.settings.custom_loader not in loaders:
            raise InstallError(
                f"engine {engine.url} does not have the in-engine loader registered (custom_weight_loader "
                f"{loaders!r}); launch SGLang with --custom-weight-loader {self.settings.custom_loader}",
                revision=request.version, field="custom_weight_loader")
        try:
            tp, pp, dp = (int(info.get(k) or 1) for k in ("tp_size", "pp_size", "dp_size"))
        except (TypeError, ValueError):
            raise InstallError(f"engine {engine.url} reports malformed parallel sizes in /server_info",
                               revision=request.version) from None
        if tp < 1 or pp < 1 or dp < 1:
            raise InstallError(f"engine {engine.url} reports tp_size {tp}, pp_size {pp}, dp_size {dp}",
                               revision=request.version)
        return tp, tp * pp * (1 if info.get("enable_dp_attention") else dp)

    def _settle(self, read: Callable[[], list], replies: list[Reply], expected: int) -> list:
        """The ranks' reports; waits (bounded) for ranks still writing theirs when every engine answered."""
        deadline = time.monotonic() + min(self.settings.timeout_s, SETTLE_MAX_S)
        reports = read()
        while (reports and all(r.status is not None for r in replies if r.sent)
               and (len(reports) < expected or not all(r.terminal for r in reports))
               and time.monotonic() < deadline):
            time.sleep(0.05)
            reports = read()
        return reports


def judge_loader_install(replies: list[Reply], reports: list, expected_ranks: int) -> tuple[str, str]:
    """(verdict, explanation) of one in-engine-loader install from the engines' answers and the ranks' reports.

    ``ok``: every engine answered success and at least ``expected_ranks`` ranks
    report ``ok`` and none reports anything else. ``untouched``: no rank may
    have changed a weight and every engine that got the request answered (one
    that did not may still run it). ``poisoned``: anything else.
    """
    unanswered = [r for r in replies if r.sent and r.status is None]
    oks = [r for r in reports if r.status == "ok"]
    lines = [r.describe() for r in replies]
    lines += [f"rank {r.tp_rank} (pid {r.pid} on {r.host}): {r.status} at {r.stage}"
              + (f": {r.message}" if r.message and r.status != "ok" else "") for r in reports]
    if not reports:
        lines.append("no rank reported: the loader did not run (check the engine's log, its "
                     "--custom-weight-loader flag and CANONICAL_REFIT_CACHE_DIR / CANONICAL_REFIT_MODEL)")
    elif len(oks) < expected_ranks:
        lines.append(f"{len(oks)} of {expected_ranks} ranks loaded")
    explanation = "; ".join(lines)
    if all(r.succeeded for r in replies) and len(oks) == len(reports) >= expected_ranks:
        return OK, explanation
    if not unanswered and not any(r.may_have_mutated for r in reports):
        return UNTOUCHED, explanation
    return POISONED, explanation


# -- sglang-disk: SGLang's own update_weights_from_disk on a stable path -------------------------------------------


def stable_path(store: LocalStore) -> Path:
    """``{store}/current``: the path engines load from; a symlink to the installed checkpoint."""
    return store.root / "current"


def switch_link(link: Path, target: str | None) -> str | None:
    """Point ``link`` at ``target`` (relative to its folder) atomically, or remove it; returns the old target."""
    if link.exists() and not link.is_symlink():
        raise InstallError(f"{link} exists and is not a symlink the receiver maintains; move it away", file=str(link))
    previous = os.readlink(link) if link.is_symlink() else None
    if target is None:
        link.unlink(missing_ok=True)
    else:
        tmp = link.with_name(f".{link.name}.{uuid.uuid4().hex[:8]}.tmp")
        os.symlink(target, tmp)
        os.replace(tmp, link)
    fsync_dir(link.parent)
    return previous


class SGLangDiskInstaller(_SGLangBase):
    """Stock SGLang: ``update_weights_from_disk`` on ``{store}/current``, switched to the prepared checkpoint."""

    name = "sglang-disk"

    def install(self, request: InstallRequest) -> InstallOutcome:
        store, started = request.store, time.perf_counter()
        infos = self._server_infos(request)
        link = stable_path(store)
        where = {"revision": request.version, "file": str(link)}
        with self._install_lock(store):
            try:
                previous = switch_link(link, store.relative(request.path))
            except OSError as exc:
                raise InstallError(f"cannot switch the stable path: {exc}", **where) from exc
            replies = each(self.engines, lambda e: e.call(
                "POST", "/update_weights_from_disk", {"model_path": str(link), "weight_version": request.version}))
        verdicts = [judge_disk_reply(reply, info) for reply, info in zip(replies, infos)]
        explanation = "; ".join(r.describe() for r in replies)
        if all(v == UNTOUCHED for v in verdicts):
            switch_link(link, previous)
            raise InstallError(f"no engine's weights were touched: {explanation}", **where)
        if any(v != OK for v in verdicts):
            raise PoisonedError(f"the engines' weights may be partially written: {explanation}", **where)
        infos = self._confirm_versions(request)
        paths = sorted({str(info.get("model_path")) for info in infos})
        detail = (f"{request.version} loaded by update_weights_from_disk from {link} -> {store.relative(request.path)} "
                  f"into {len(self.engines)} engine(s) in {time.perf_counter() - started:.2f}s; engine model_path "
                  f"{', '.join(paths)}; weight_version {request.version} confirmed")
        log.info(detail)
        return InstallOutcome(detail, tuple(e.url for e in self.engines))


def judge_disk_reply(reply: Reply, server_info: dict) -> str:
    """``ok``, ``untouched`` or ``poisoned`` for one engine's answer to ``update_weights_from_disk``.

    Not sent, or refused with a 4xx other than 400 (validation, auth, no such
    endpoint): untouched. 400 with SGLang's loader set-up messages: untouched,
    unless a draft model is configured (SGLang stops at the first failing
    runner, so the target may already be updated). Everything else after the
    request reached the engine, timeouts and malformed answers included, is
    poisoned: SGLang's "rollback" does not restore the previous weights.
    """
    if not reply.sent:
        return UNTOUCHED
    if reply.succeeded:
        return OK
    if reply.status is not None and 400 < reply.status < 500:
        return UNTOUCHED
    body = reply.body if isinstance(reply.body, dict) else {}
    message = body.get("message")
    if (reply.status == 400 and body.get("success") is False and isinstance(message, str)
            and not server_info.get("speculative_algorithm")
            and all(part.strip().startswith(_DISK_SETUP_FAILURES) for part in message.split(" | "))):
        return UNTOUCHED
    return POISONED
