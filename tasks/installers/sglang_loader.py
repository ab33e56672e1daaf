"""The in-engine loader: SGLang runs it to load the receiver's prepared checkpoint (docs/sglang.md).

Register it when launching SGLang, with the receiver's store in the engine's environment::

    CANONICAL_REFIT_CACHE_DIR=/cache CANONICAL_REFIT_MODEL=org/name \\
    python -m sglang.launch_server ... \\
        --custom-weight-loader tasks.installers.sglang_loader.load_prepared_checkpoint

The ``sglang`` installer then calls ``POST /update_weights_from_tensor`` with
``load_format`` set to that import path and one empty tensor list per TP rank,
and SGLang calls ``load_prepared_checkpoint(model, [])`` inside every TP rank's
scheduler process. The hook gets nothing but ``(model, named_tensors)``, so what
to install travels in a small request record the receiver writes just before
the call, and the outcome travels back the same way, one report per rank::

    {store}/install/request.json                  version, digests, folder, file identity, deadline
    {store}/install/reports/{request_id}/*.json   validating -> loading -> ok | failed

The hook never raises: SGLang answers "Success" whatever a custom loader did,
and an exception escaping into its scheduler takes the whole server down. The
report is therefore the only trustworthy outcome, and it says whether a failure
came before the model's weights were touched (validation, loader setup,
iterator construction) or after loading began.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time
import uuid
from dataclasses import asdict, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Literal, Protocol

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from storage.durable import atomic_write_json, remove_tree
from storage.jsonio.bounded_json import STORE_RECORD, load_json, parse_record, read_bounded, read_record
from storage.errors import FormatError, InstallError
from storage.store.local_store import READY, LocalStore, now_ms
from storage.store.records import Files
from storage.settings import DEFAULT_CACHE_DIR, Settings, settings_config
from tasks.installers.weights_reader import READ_THREADS, parallel_weights

log = logging.getLogger("canonical_refit.sglang_loader")

LOADER_PATH = "tasks.installers.sglang_loader.load_prepared_checkpoint"
REQUEST_SCHEMA = "canonical-refit.install-request.v1"
VALIDATING, LOADING, OK, FAILED = "validating", "loading", "ok", "failed"
TERMINAL = (OK, FAILED)


class LoaderSettings(Settings):
    """Where the engine finds the receiver's store (the receiver's own variables, prefix ``CANONICAL_REFIT_``)."""

    model_config = settings_config("CANONICAL_REFIT_")

    cache_dir: Path = Field(DEFAULT_CACHE_DIR, description="root of the receiver's local checkpoint store")
    model: str | None = Field(None, description="model id whose store the receiver prepares, e.g. org/name")
    loader_lock_timeout_s: float = Field(60.0, gt=0, description="longest wait for the store's shared lock")
    loader_reader: Literal["parallel", "sglang"] = Field(
        "parallel", description="who reads the prepared checkpoint's files: the loader's own threaded reader "
                                "(tasks/installers/weights_reader.py) or SGLang's configured one")


# -- the request and report records --------------------------------------------------------------


@dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid"))
class LoadRequest:
    """``install/request.json``: the verified checkpoint the engine must load, and until when.

    A strict record (read through ``storage.jsonio.bounded_json``): a field of the wrong type, a missing one
    or a key it does not know is refused as a ``FormatError`` naming the file and the field. Only this program
    writes it (the receiver), for this program (the loader in the engine); ``schema`` names its version."""

    request_id: str
    model: str
    version: str
    digest: str
    format_digest: str
    path: str  # checkpoint folder, relative to the store root
    files: Files
    installer: str
    created_at_unix_ms: int
    deadline_unix_ms: int
    schema: Literal["canonical-refit.install-request.v1"] = REQUEST_SCHEMA

    @classmethod
    def from_json(cls, raw: object, *, file: str) -> "LoadRequest":
        """Parse and check every field; a bad record raises ``FormatError`` naming the file and the field."""
        if isinstance(raw, dict) and "schema" not in raw:  # written by every receiver: its absence is damage
            raise FormatError("the install request has no 'schema'", file=file, field="schema")
        return parse_record(cls, raw, error=FormatError, file=file)


@dataclass(config=ConfigDict(strict=True, extra="ignore"))
class LoadReport:
    """One rank's account of one request: where it got to, and whether weights may have changed.

    A strict record too, but a key it does not know is ignored: the engine's loader may be a newer copy of
    this program than the receiver reading its report, and a report refused reads as a rank that may have
    changed the engine's weights."""

    request_id: str
    version: str
    status: str = VALIDATING
    mutation_started: bool = False
    stage: str = "validation"
    message: str = ""
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    tp_rank: int | None = None
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    updated_at_unix_ms: int = 0

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def may_have_mutated(self) -> bool:
        """True unless this rank provably stopped before touching the model's weights."""
        return self.mutation_started or self.status not in (VALIDATING, FAILED)


def install_dir(store: LocalStore) -> Path:
    return store.root / "install"


def request_path(store: LocalStore) -> Path:
    return install_dir(store) / "request.json"


def reports_dir(store: LocalStore, request_id: str) -> Path:
    return install_dir(store) / "reports" / request_id


def write_request(store: LocalStore, request: LoadRequest) -> None:
    """Publish the request for the engine (removes reports of earlier requests first)."""
    remove_tree(install_dir(store) / "reports")
    atomic_write_json(request_path(store), asdict(request))


def read_request(store: LocalStore) -> LoadRequest | None:
    """The request the receiver wrote, None if there is none; ``FormatError`` naming the file if it is refused."""
    path = request_path(store)
    raw = read_bounded(path, STORE_RECORD, error=FormatError, missing_ok=True, file=str(path))
    if raw is None:
        return None
    return LoadRequest.from_json(load_json(raw, STORE_RECORD, error=FormatError, file=str(path)), file=str(path))


def read_reports(store: LocalStore, request_id: str) -> list[LoadReport]:
    """Every rank's report for ``request_id`` (an unreadable report reads as a rank that may have mutated)."""
    folder = reports_dir(store, request_id)
    out = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        try:
            out.append(read_record(path, LoadReport, STORE_RECORD, error=FormatError, file=str(path)))
        except FormatError as exc:
            log.warning("a rank's load report is refused, counted as a rank that may have changed the "
                        "engine's weights: %s", exc)
            out.append(LoadReport(request_id, "?", status="unreadable", message=f"unreadable report {path}: "
                                                                                  f"{exc.reason}"))
    return out


class _Reporter:
    """Writes this rank's report; a report that cannot be written stops the load before it starts."""

    def __init__(self, store: LocalStore, request: LoadRequest, tp_rank: int | None):
        self.report = LoadReport(request.request_id, request.version, tp_rank=tp_rank)
        self.path = reports_dir(store, request.request_id) / f"{uuid.uuid4().hex}.json"
        self.started = time.perf_counter()

    def write(self, **changes) -> None:
        """Write the report with ``changes``; they take effect only once written."""
        updated = LoadReport(**(asdict(self.report) | changes))
        updated.seconds = round(time.perf_counter() - self.started, 3)
        updated.updated_at_unix_ms = now_ms()
        atomic_write_json(self.path, asdict(updated), durable=False)
        self.report = updated


# -- SGLang's loader, behind a thin adapter -----------------------------------------------------------


class WeightLoader(Protocol):
    """What the hook needs from SGLang: an iterator over a folder's weights, and a way to load it."""

    def weights(self, model, folder: Path) -> Iterable[tuple[str, object]]: ...

    def load(self, model, weights: Iterable[tuple[str, object]]) -> None: ...


class SGLangDefaultLoader:
    """SGLang's ``DefaultModelLoader`` with a safetensors ``LoadConfig`` and our own ``Source``; our reader.

    The runner's ``model_config`` and load config are never touched: the
    ``Source`` points at the prepared folder directly, instead of going through
    ``update_weights_from_disk``, which rewrites the runner's configured model
    path before loading. SGLang is imported here, lazily, so this module imports
    without it.
    """

    def __init__(self, threads: int = READ_THREADS, reader: str | None = None):
        from sglang.srt.configs.load_config import LoadConfig, LoadFormat
        from sglang.srt.model_loader.loader import DefaultModelLoader

        self.threads = threads
        self.reader = reader or LoaderSettings().loader_reader
        self._cls = DefaultModelLoader
        self._loader = DefaultModelLoader(LoadConfig(load_format=LoadFormat.SAFETENSORS))

    def weights(self, model, folder: Path) -> Iterable[tuple[str, object]]:
        """SGLang resolves and checks the folder as for any load; ``parallel_weights`` reads it.

        With no prefix, no draft model and no ``model_config``, SGLang's
        iterator adds nothing to the files' tensors but the choice of files,
        which for our prepared folder is the index's shards, as
        ``parallel_weights`` reads them. A model that picks its own files
        (``allow_patterns_overrides``) keeps SGLang's reader, and so does every
        model with ``CANONICAL_REFIT_LOADER_READER=sglang``. Building SGLang's
        iterator reads no tensor: its generator has not started.
        """
        overrides = getattr(model, "allow_patterns_overrides", None)
        source = self._cls.Source(
            model_or_path=str(folder), revision=None, prefix="", fall_back_to_pt=False,
            allow_patterns_overrides=overrides,
            model_config=None,  # not the runner's: nothing of it is read or written
        )
        sglang_weights = self._loader._get_weights_iterator(source)
        if overrides is not None or self.reader == "sglang":
            return sglang_weights
        getattr(sglang_weights, "close", lambda: None)()
        return parallel_weights(folder, self.threads)

    def load(self, model, weights: Iterable[tuple[str, object]]) -> None:
        device = _model_device(model)
        restore = getattr(self._cls, "restore_weights_before_loading", None)
        if restore is not None:  # undo in-place quantization packing, as SGLang's own reload does
            restore(model, device)
        self._cls.load_weights_and_postprocess(model, weights, device)

    @staticmethod
    def tp_rank() -> int | None:
        """This rank's TP index, from SGLang's runtime context (0.5.23 no longer exports the old getter)."""
        try:
            from sglang.srt.runtime_context import get_parallel

            return int(get_parallel().tp_rank)
        except Exception:
            return None


def _model_device(model):
    import torch

    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")


# -- the hook --------------------------------------------------------------------------------------------


def load_prepared_checkpoint(model, named_tensors, *, settings: LoaderSettings | None = None,
                             loader_factory: Callable[[], WeightLoader] | None = None) -> None:
    """SGLang custom weight loader: load the checkpoint ``install/request.json`` names into ``model``.

    Called by SGLang as ``fn(model, named_tensors)`` in each TP rank; the
    keyword arguments exist for tests and benchmarks. Validates the request against the store
    (state READY, version, digests, file identity) under the store's shared
    lock, reads it with ``parallel_weights``, loads it through SGLang's
    ``DefaultModelLoader`` and reports the outcome in ``install/reports/``.
    Never raises.
    """
    factory = loader_factory or SGLangDefaultLoader
    try:
        settings = settings or LoaderSettings()
        if not settings.model:
            raise InstallError("CANONICAL_REFIT_MODEL is not set in the engine's environment; "
                               "the loader cannot find the receiver's store")
        store = LocalStore(settings.cache_dir, settings.model)
        request = read_request(store)
        if request is None:
            raise InstallError("no install request: the loader runs only through the `sglang` installer",
                               file=str(request_path(store)))
    except Exception as exc:  # nowhere to report: the installer sees no report, i.e. nothing loaded
        log.error("not loading: %s", exc)
        return
    reporter = _Reporter(store, request, getattr(factory, "tp_rank", lambda: None)())
    try:
        reporter.write()
    except OSError as exc:
        log.error("not loading %s: cannot write the load report %s: %s", request.version, reporter.path, exc)
        return
    try:
        _load(model, named_tensors, store, request, settings, factory, reporter)
    except Exception as exc:
        mutated = reporter.report.status == LOADING
        log.error("loading %s %s: %s", request.version, "FAILED after weights may have changed" if mutated
                  else "failed before any weight changed", exc)
        try:
            reporter.write(status=FAILED, mutation_started=mutated, message=f"{type(exc).__name__}: {exc}")
        except OSError as report_exc:  # the report still says where it got to
            log.error("cannot write the load report %s: %s", reporter.path, report_exc)


def _load(model, named_tensors, store: LocalStore, request: LoadRequest, settings: LoaderSettings,
          factory: Callable[[], WeightLoader], reporter: _Reporter) -> None:
    if len(named_tensors or ()) != 0:
        raise InstallError(f"this loader takes its weights from the store, but SGLang passed "
                           f"{len(named_tensors)} tensors", revision=request.version)
    with store.shared(settings.loader_lock_timeout_s, "engine load"):
        folder = _validate(store, request)
        reporter.write(stage="loader setup")
        loader = factory()
        reporter.write(stage="iterator")
        weights = _peeked(loader.weights(model, folder), request, folder)
        counter = _Counter()
        reporter.write(status=LOADING, stage="load")
        loader.load(model, counter.count(weights))
        if counter.tensors == 0:
            raise InstallError("the engine's loader consumed no tensor", revision=request.version, file=str(folder))
        if not store.files_match(request.path, request.files):
            raise InstallError("the checkpoint's files changed while the engine loaded them",
                               revision=request.version, file=str(folder))
    reporter.write(status=OK, stage="done", tensors=counter.tensors, bytes=counter.bytes,
                   message=f"loaded {counter.tensors} tensors ({counter.bytes:,} bytes) from {folder}")
    log.info("loaded %s: %d tensors, %d bytes from %s in %.3fs", request.version, counter.tensors,
             counter.bytes, folder, reporter.report.seconds)


def _validate(store: LocalStore, request: LoadRequest) -> Path:
    """The prepared checkpoint must be READY, verified, intact and exactly the one requested."""
    where = {"revision": request.version, "file": str(store.state_path)}
    if now_ms() > request.deadline_unix_ms:
        raise InstallError("the install request expired before the engine ran it", **where)
    if request.model != store.model:
        raise InstallError(f"the request is for model {request.model!r}, this store holds {store.model!r}",
                           field="model", **where)
    state = store.state()
    if state is None or state.status != READY:
        raise InstallError(f"the store is {state.status if state else 'empty'}, not READY", field="status", **where)
    current = store.current()
    if current is None:
        raise InstallError(f"the store's current checkpoint {state.version} is not verified and intact", **where)
    for name, have, want in (("version", current.version, request.version),
                             ("digest", current.target_digest, request.digest),
                             ("format_digest", current.format_digest, request.format_digest),
                             ("path", current.path, request.path),
                             ("files", current.files, request.files)):
        if have != want:
            raise InstallError(f"the store's prepared checkpoint has {name} {have!r}, the request {want!r}",
                               field=name, **where)
    return store.absolute(current.path)


def _peeked(weights: Iterable, request: LoadRequest, folder: Path) -> Iterator:
    """Open the iterator and read its first tensor before loading, so setup errors surface early."""
    iterator = iter(weights)
    try:
        first = next(iterator)
    except StopIteration:
        raise InstallError("the checkpoint yields no tensors", revision=request.version, file=str(folder)) from None
    return itertools.chain([first], iterator)


class _Counter:
    def __init__(self):
        self.tensors = 0
        self.bytes = 0

    def count(self, weights: Iterator) -> Iterator:
        for name, tensor in weights:
            self.tensors += 1
            self.bytes += int(tensor.numel()) * int(tensor.element_size())
            yield name, tensor
