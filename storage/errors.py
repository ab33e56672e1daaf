"""One exception hierarchy for the whole pipeline.

Every error carries the context a user needs to act on it: the revision, the
file (an object URI or a local path) and the tensor concerned, where known.
The message always names them, so a log line or a Prefect state message is
enough to find the bad input.
"""

from __future__ import annotations


class RefitError(Exception):
    """Base of every error this project raises on purpose.

    ``transient`` tells the retry layer whether trying again may succeed;
    ``mutation_started`` tells it whether the local checkpoint may already
    hold partially written bytes (a stage must then never be retried).
    """

    transient = False

    def __init__(
        self,
        message: str,
        *,
        revision: str | None = None,
        file: str | None = None,
        tensor: str | None = None,
        field: str | None = None,
        local_file: str | None = None,
        mutation_started: bool = False,
    ) -> None:
        self.reason = message
        self.revision = revision
        self.file = file
        self.tensor = tensor
        self.field = field
        self.local_file = local_file
        self.mutation_started = mutation_started
        super().__init__(self._render())

    def _render(self) -> str:
        where = [
            f"{label} {value!r}"
            for label, value in (
                ("revision", self.revision),
                ("file", self.file),
                ("tensor", self.tensor),
                ("field", self.field),
                ("local file", getattr(self, "local_file", None)),
            )
            if value is not None
        ]
        return f"{self.reason} ({', '.join(where)})" if where else self.reason

    def with_context(self, **context: str | None) -> "RefitError":
        """Fill in context fields that are still unknown; returns self."""
        for key, value in context.items():
            if value is not None and getattr(self, key, None) is None:
                setattr(self, key, value)
        self.args = (self._render(),)
        return self

    def __reduce__(self):  # keep context across pickling (Prefect results, subprocesses)
        return (_rebuild, (type(self), self.reason, self.__dict__.copy()))

    def to_dict(self) -> dict:
        return {
            "type": type(self).__name__,
            "message": str(self),
            "revision": self.revision,
            "file": self.file,
            "tensor": self.tensor,
            "field": self.field,
            "local_file": getattr(self, "local_file", None),
            "mutation_started": self.mutation_started,
        }


def _rebuild(cls, reason, state):
    err = cls.__new__(cls)
    Exception.__init__(err, reason)
    err.__dict__.update(state)
    err.args = (err._render(),)
    return err


class Cancelled(RefitError):
    """Work stopped on request: the run is ending because another stage failed."""


class Interrupted(RefitError):
    """The run was stopped from outside: Ctrl-C, SIGTERM or a Prefect cancellation."""


class StageDeadlineExceeded(Cancelled):
    """A stage ran past its deadline (``stage_deadline_s``): the run stopped at its next safe point, as a
    cancellation would (a ``Cancelled``: code that lets a stop through lets this through), and failed (not
    interrupted).

    Transient: a stalled link or an outage is what a deadline catches, so the
    whole run is retried after its rollback like any other transient failure
    (``RefitParams.retries``); the stage itself is never retried.
    """

    transient = True

    def __init__(self, stage: str, seconds: float, *, revision: str | None = None, **context) -> None:
        self.stage, self.seconds = stage, seconds
        super().__init__(f"stage {stage!r} of {revision or 'this run'} exceeded its deadline of {seconds:g}s",
                         revision=revision, **context)

    def _render(self) -> str:  # the message names the revision already
        return self.reason

    def to_dict(self) -> dict:
        return {**super().to_dict(), "stage": self.stage, "seconds": self.seconds}


# --- object storage -----------------------------------------------------------


class StorageError(RefitError):
    """A read or write against object storage failed."""


class TransientStorageError(StorageError):
    """Timeouts, throttling, 5xx, resets, short bodies: worth retrying."""

    transient = True


class PermanentStorageError(StorageError):
    """Missing object, access denied, invalid request: retrying cannot help."""


class ObjectNotFound(PermanentStorageError):
    pass


class AccessDenied(PermanentStorageError):
    pass


class InvalidURI(PermanentStorageError):
    pass


class NotRegularFile(PermanentStorageError):
    """A local object or launch file is a FIFO, socket, device or folder: refused without reading it."""


class ImmutableConflict(StorageError):
    """A create-only write found different bytes already published."""


class ConditionalWritesUnsupported(StorageError):
    """The server silently overwrites objects instead of enforcing If-None-Match."""


# --- bad input ----------------------------------------------------------------


class FormatError(RefitError):
    """Malformed or inconsistent input: a record, manifest, header or frame."""


class CatalogError(FormatError):
    """A catalog record breaks the rules of the revision schema."""


class SignatureError(CatalogError):
    """A node with trusted keys met a catalog record that is unsigned, signed by another key, or altered since."""


class ManifestError(FormatError):
    """An index manifest is malformed or does not match its catalog record."""


class SafetensorsError(FormatError):
    """A safetensors header is malformed or runs past its file."""


class CodecError(FormatError):
    """A delta frame or sparse record is malformed, truncated or oversized."""


class ChecksumMismatch(FormatError):
    """Bytes do not hash to the checksum or digest that was published."""


class CheckpointMismatch(FormatError):
    """Tensor set, dtype, shape or size differ from the local checkpoint."""


class LineageError(FormatError):
    """The replay chain is broken: wrong base, missing revision, cycle."""


# --- local store --------------------------------------------------------------


class StoreError(RefitError):
    """The local checkpoint store cannot do what was asked."""


class StoreRecordError(StoreError, ValueError):
    """A file of the store is not a bounded, strict JSON document (torn, hostile or too big); also a
    ``ValueError``, so a reader that treats a torn memo as missing keeps doing so."""


class CapacityError(StoreError):
    """The cache quota cannot make room without evicting protected data."""


class StoreBusy(StoreError):
    """Another process held the store's lock for longer than we may wait."""


class TamperedCheckpoint(StoreError):
    """Files of a recorded checkpoint changed outside the receiver."""


# --- installation -------------------------------------------------------------


class InstallError(RefitError):
    """Installation failed before the engine's weights were touched."""


class PoisonedError(InstallError):
    """The engine may hold partially written weights; recovery is required."""

    def __init__(self, message: str, **context) -> None:
        context.setdefault("mutation_started", True)
        super().__init__(message, **context)


class ReceiverPoisoned(InstallError):
    """Installs are refused until ``recover`` re-installs a verified checkpoint."""


# --- the control plane ----------------------------------------------------------


class RollbackRefused(RefitError):
    """A run's target is older than the installed revision and this node's configuration refuses rollbacks."""
