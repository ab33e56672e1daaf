"""Configuration: one pydantic model per concern.

Each model validates on construction and reads environment variables with
one prefix, so the CLI, the flow parameters and the deployments all build the
same objects. Credentials are never fields here: S3 clients take them from the
standard AWS environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_PROFILE``), so they never land in a flow run's
stored parameters.

``Settings`` reads the environment as pydantic-settings' source did (``env_values``) without importing
it and asyncio, and builds a model's validators on first use: ``--help`` and ``status`` start quickly.
"""

from __future__ import annotations

import json
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence, Set
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from storage.retry import RetryPolicy

VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
MODEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$"
MIB = 2**20
DEFAULT_CACHE_DIR = Path(os.path.expanduser("~/.cache/canonical-refit"))


def _valid_url(value: str) -> str:
    """Reject malformed object URLs (``s3://bucket//key``, ``?query``, ...) when settings are built."""
    from storage.errors import InvalidURI
    from storage.urls import normalize_url

    try:
        normalize_url(value)
    except InvalidURI as exc:
        raise ValueError(exc.reason) from None
    return value


NODE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


def default_node_name() -> str:
    """This host's node name when none is configured: the host name, made a valid id."""
    import socket

    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname() or "node").lstrip("._-") or "node"
    return name[:128]


def _workers_default() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class NoDecode:
    """``Annotated[list[str], NoDecode]``: the field's environment value is passed on as written (the field's
    own validator parses it), not decoded as JSON."""


def settings_config(env_prefix: str) -> ConfigDict:
    """A settings model's configuration: the prefix of its environment variables."""
    return ConfigDict(env_prefix=env_prefix)  # type: ignore[typeddict-unknown-key]  (read by Settings, options)


def _json_valued(annotation: Any) -> bool:
    """Whether an environment value of this type is JSON: a model, a list, a tuple, a set or a mapping."""
    origin = typing.get_origin(annotation) or annotation
    if not isinstance(origin, type) or issubclass(origin, (str, bytes)):
        return False
    return issubclass(origin, (BaseModel, Mapping, Sequence, Set, tuple))


def env_values(model: type[BaseModel]) -> dict:
    """The values ``model``'s environment sets: ``{prefix}{field}`` in any case; JSON for a model, list or
    mapping field (a union with one keeps a value that is not JSON as written); a ``NoDecode`` field as written."""
    prefix = (model.model_config.get("env_prefix") or "").lower()
    environ = {name.lower(): value for name, value in os.environ.items()}
    values: dict = {}
    for name, info in model.model_fields.items():
        raw = environ.get(f"{prefix}{name}".lower())
        if raw is None:
            continue
        union = isinstance(info.annotation, types.UnionType) or typing.get_origin(info.annotation) is typing.Union
        members = typing.get_args(info.annotation) if union else (info.annotation,)
        if NoDecode in info.metadata or not any(_json_valued(member) for member in members):
            values[name] = raw
            continue
        try:
            values[name] = json.loads(raw)
        except ValueError:
            if not union:
                raise ValueError(f'error parsing value for field "{name}" from source "EnvSettingsSource": '
                                 f"{prefix.upper()}{name.upper()} is not JSON") from None
            values[name] = raw
    return values


def _merged(under: dict, over: Mapping) -> dict:
    """``under`` updated with ``over``, nested dicts merged (``over`` wins)."""
    out = dict(under)
    for key, value in over.items():
        below = out.get(key)
        out[key] = _merged(below, value) if isinstance(below, dict) and isinstance(value, Mapping) else value
    return out


class Settings(BaseModel):
    """A model whose fields not given as keywords come from its environment (``env_values``), then defaults."""

    model_config = ConfigDict(extra="ignore", validate_default=True, arbitrary_types_allowed=True, defer_build=True)

    def __init__(self, **values: Any) -> None:
        super().__init__(**_merged(env_values(type(self)), values))


class ObjectStoreSettings(Settings):
    """How to reach object storage (env prefix ``CANONICAL_REFIT_S3_``, e.g. ``CANONICAL_REFIT_S3_ENDPOINT_URL``).

    The endpoint and region fall back to botocore's own environment
    (``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``).
    Every request gets ``retry_attempts`` attempts in all, with exponential
    backoff from ``backoff_initial_s`` up to ``backoff_max_s`` (jittered);
    botocore's and s3fs's own retries are turned off so that each one is counted.
    """

    model_config = settings_config("CANONICAL_REFIT_S3_")

    endpoint_url: str | None = Field(None, description="S3 endpoint, e.g. http://127.0.0.1:9000")
    region: str | None = Field(None, description="S3 region name")
    anonymous: bool = Field(False, description="unsigned requests (public buckets)")
    addressing_style: Literal["auto", "path", "virtual"] = Field(
        "auto", description="S3 addressing: path (http://host/bucket/key, for most self-hosted servers), "
                            "virtual (http://bucket.host/key) or auto")
    connect_timeout_s: float = Field(5.0, gt=0, description="seconds to open a connection")
    read_timeout_s: float = Field(30.0, gt=0, description="seconds without a byte before a request is abandoned")
    max_pool_connections: int = Field(32, ge=1, le=1024, description="HTTP connections kept per client")
    concurrency: int = Field(8, ge=1, le=256, description=(
        "connection budget: data requests (GET bodies, byte ranges, upload parts) in flight at once, "
        "shared by every download and upload of a store; also how many objects are fetched at once"))
    retry_attempts: int = Field(6, ge=1, le=50, description="attempts per request, first included")
    backoff_initial_s: float = Field(0.2, ge=0, description="wait before the first retry")
    backoff_max_s: float = Field(10.0, ge=0, description="longest wait between attempts")
    block_size: int = Field(64 * MIB, ge=5 * MIB, le=5 * 2**30,
                            description="bytes per multipart-upload part (S3: 5 MiB to 5 GiB) and per "
                                        "ranged read of a content comparison")
    range_size: int = Field(32 * MIB, ge=256 * 2**10, le=5 * 2**30, description=(
        "the largest byte range of a download: a larger object is fetched as ranges in parallel on the "
        "connection budget, sized to fill whole waves of `concurrency` (not below 8 MiB), and resumes from the "
        "last recorded byte of each range after an interruption. Measured against a proxy "
        "modelling S3 (100 MB/s per connection, 5 ms per request; `python -m benchmarks.transfer --curve-only`, "
        "8 connections): a 2000 MB object came at 299/446/483 MB/s with 16/32/64 MiB ranges, a 256 MiB "
        "bucket at 491/520/340 MB/s (64 MiB ranges leave half the connections idle): 32 MiB is the best "
        "of both. Tests use smaller ranges"))

    def retry_policy(self) -> RetryPolicy:
        """The retry policy of one request."""
        return RetryPolicy(self.retry_attempts, self.backoff_initial_s, 2.0, self.backoff_max_s, jitter=0.5)

    @model_validator(mode="after")
    def _backoff_bounds(self) -> "ObjectStoreSettings":
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(f"backoff_max_s ({self.backoff_max_s}) is below backoff_initial_s "
                             f"({self.backoff_initial_s})")
        return self


class InstallerSettings(Settings):
    """Which engine to install into (env prefix ``CANONICAL_REFIT_INSTALLER_``)."""

    model_config = settings_config("CANONICAL_REFIT_INSTALLER_")

    kind: Literal["none", "sglang", "sglang-disk"] = Field(
        "none", description="how to install into the engine: none (record only), sglang (the in-engine "
                            "loader) or sglang-disk (SGLang's update_weights_from_disk)")
    engine_urls: list[str] = Field(default_factory=list,
                                   description="engine base URL, e.g. http://127.0.0.1:30000 (one per replica)")
    timeout_s: float = Field(600.0, gt=0, description="per-engine install request timeout")
    api_key: str | None = Field(None, description="bearer token for the engines' admin API", exclude=True)
    custom_loader: str = Field(
        "tasks.installers.sglang_loader.load_prepared_checkpoint",
        description="import path the engines were launched with as --custom-weight-loader (sglang installer)")

    @model_validator(mode="after")
    def _engines_for_engine_installers(self) -> "InstallerSettings":
        if self.kind != "none" and not self.engine_urls:
            raise ValueError(f"installer {self.kind!r} needs at least one engine URL")
        return self


class RefitParams(Settings):
    """Parameters of one refit (env prefix ``CANONICAL_REFIT_``)."""

    model_config = settings_config("CANONICAL_REFIT_")

    catalog: str = Field(..., description="catalog URL: s3://bucket/prefix, file:///path or a local path")
    model: str = Field(..., pattern=MODEL_PATTERN, description="model id, e.g. org/name")
    node: str = Field(default_factory=default_node_name, pattern=NODE_PATTERN,
                      description="this node's name in the fleet view (default: the host name)")
    target: str = Field("latest", description="version to install, or 'latest'")
    initial_version: str | None = Field(None, description="launch revision (default: the sequence-0 record)")
    seed_checkpoint: str | None = Field(None, description="local path of the launch HF snapshot")
    seed_links: bool = Field(True, description="hard-link the launch snapshot's weight files into the store where "
                                               "the filesystem allows (off: copy them, for a launch folder that is "
                                               "rewritten in place)", json_schema_extra={"flag": "--no-seed-links"})
    cache_dir: Path = Field(DEFAULT_CACHE_DIR, description="root of the local checkpoint store")
    cache_max_gb: float = Field(500.0, gt=0, description="byte quota of the store, decimal GB")
    apply_workers: int = Field(default_factory=_workers_default, ge=1, le=256,
                               description="threads applying tensors (default: the cores, at most 8)")
    verify: Literal["incremental", "full"] = Field(
        "incremental", description="'full' rereads every tensor instead of reusing verified checksums"
    )
    lock_timeout_s: float = Field(3600.0, gt=0, description="longest wait for another receiver's lock",
                                  json_schema_extra={"flag": "--lock-timeout"})
    activate: bool = Field(
        True, description="record the installed version as active once installed (else activate it later with "
                          "`python -m flows.refit activate`)")
    only_if_newer: bool = Field(
        False, description="do nothing when the target is not newer than the installed revision"
    )
    rollbacks: Literal["allow", "refuse"] = Field(
        "allow", description="a target older than the installed revision: install it (allow), or refuse the run "
                             "before any download (refuse; what a node agent pins unless --allow-remote-rollback)")
    retries: int = Field(
        3, ge=0, le=20,
        description="whole-run retries after a transient failure (a storage outage); never after poison, "
                    "an interrupt or bad input")
    retry_delay_s: float = Field(
        10.0, ge=0, le=3600, description="wait before the first whole-run retry, doubled for each next one",
        json_schema_extra={"flag": "--retry-delay"})
    stage_deadline_s: float | None = Field(
        None, gt=0, description="longest a stage of the run may take (seconds; default: no deadline): past it the "
                                "run stops at its next safe point, rolls back and fails with StageDeadlineExceeded, "
                                "which the whole run retries like a transient failure (retries)",
        json_schema_extra={"flag": "--stage-deadline-seconds"})
    stage_retries: int = Field(
        2, ge=0, le=20, description="deprecated, no effect: a stage runs once (its requests retry transient I/O, "
                                    "the whole run retries: retries); accepted so command lines keep working")
    stage_retry_delay_s: float = Field(
        1.0, ge=0, le=3600, description="deprecated, no effect (see stage_retries)",
        json_schema_extra={"flag": "--stage-retry-delay"})
    trusted_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Ed25519 public key whose signature this node accepts on catalog records: a key file's path, "
                    "or the key inline (PEM, 'ssh-ed25519 ...' or 32 bytes of base64); several for a key rotation "
                    "(environment: a JSON array or commas). With any, a record that is unsigned, signed by another "
                    "key or altered after signing is refused before a payload byte is downloaded (docs/format.md, "
                    "4.10); without, records are not verified", json_schema_extra={"flag": "--trusted-key"})
    storage: ObjectStoreSettings = Field(default_factory=ObjectStoreSettings, json_schema_extra={
        "flags": {"concurrency": "--fetch-workers", "endpoint_url": "--s3-endpoint-url"}})
    installer: InstallerSettings = Field(default_factory=InstallerSettings, json_schema_extra={
        "flags": {"kind": "--installer", "engine_urls": "--engine-url"}})

    @field_validator("trusted_keys", mode="before")
    @classmethod
    def _trusted_keys_list(cls, value):
        if isinstance(value, str):  # the environment: a JSON array, or keys separated by commas
            text = value.strip()
            value = json.loads(text) if text.startswith("[") else [k for k in text.split(",") if k.strip()]
        return value

    @field_validator("trusted_keys")
    @classmethod
    def _trusted_keys_load(cls, value: list[str]) -> list[str]:
        from storage.keys import load_public_key

        for entry in value:
            load_public_key(entry)  # a ValueError naming the entry: a node never runs with a key it cannot read
        return value

    def run_retry_policy(self) -> RetryPolicy:
        """Retries of the whole run after a transient failure."""
        return RetryPolicy(self.retries + 1, self.retry_delay_s, 2.0)

    @field_validator("catalog")
    @classmethod
    def _catalog_form(cls, value: str) -> str:
        return _valid_url(value)

    @field_validator("target")
    @classmethod
    def _target_form(cls, value: str) -> str:
        if value != "latest" and not re.match(VERSION_PATTERN, value):
            raise ValueError(f"target {value!r} is neither 'latest' nor a valid version id")
        return value

    @field_validator("initial_version")
    @classmethod
    def _initial_form(cls, value: str | None) -> str | None:
        if value is not None and not re.match(VERSION_PATTERN, value):
            raise ValueError(f"initial version {value!r} is not a valid version id")
        return value

    @property
    def quota_bytes(self) -> int:
        return int(self.cache_max_gb * 1e9)


class PublishParams(Settings):
    """Parameters of one publication (env prefix ``CANONICAL_REFIT_PUBLISH_``)."""

    model_config = settings_config("CANONICAL_REFIT_PUBLISH_")

    catalog: str = Field(..., description="catalog URL the record is written to: s3://bucket/prefix, "
                                          "file:///path or a local path")
    model: str = Field(..., pattern=MODEL_PATTERN, description="model id, e.g. org/name")
    checkpoint: Path = Field(..., description="local folder of the safetensors checkpoint to publish")
    kind: Literal["initial", "full", "delta"] = Field(
        "delta", description="initial: revision 0 describing the launch snapshot (an empty catalog only); "
                             "full: a full checkpoint; delta: an XOR delta against the exact base")
    version: str | None = Field(None, pattern=VERSION_PATTERN,
                                description="version id of the new revision (default: r{sequence})")
    payload_url: str | None = Field(None, description="where payload objects go (default: "
                                                      "{catalog}/../revisions/{version})")
    base_version: str | None = Field(None, pattern=VERSION_PATTERN,
                                     description="revision the delta applies to (default: the latest)")
    base_checkpoint: Path | None = Field(
        None, description="local copy of the base revision (default: the publisher's own last copy)"
    )
    state_dir: Path = Field(
        DEFAULT_CACHE_DIR / "publisher", description="where the publisher keeps its copy of the last published "
                                                     "checkpoint"
    )
    keep_copy: bool = Field(True, description="keep a copy of what was published as the next delta's base")
    encoding: Literal["xor", "xor_sparse", "overwrite", "auto", "xor_gaps"] = Field(
        "xor", description="delta encoding: auto measures the canonical encodings and zstd levels on a sample of "
                           "the revision and keeps the smallest; xor_gaps is an opt-in extension older receivers "
                           "cannot read (docs/format.md, 5.6)")
    checksum_format: Literal["adler32", "xxh3-128", "blake3"] = Field(
        "adler32", description="per-tensor checksum of initial and full revisions (a delta uses its base's)")
    bucket_max_mib: int = Field(256, ge=1, description="decoded MiB per delta bucket",
                                json_schema_extra={"flag": "--bucket-mib"})
    zstd_level: int = Field(3, ge=-7, le=22, description="zstd compression level")
    workers: int = Field(default_factory=_workers_default, ge=1, le=256,
                         description="threads encoding tensors (default: the cores, at most 8)")
    allow_unconditional_writes: bool = Field(
        False, description="publish even if the object store does not enforce create-only writes "
                           "(If-None-Match)"
    )
    emit_event: bool = Field(True, description="emit canonical-refit.revision.published once the record is "
                                               "written", json_schema_extra={"flag": "--no-event"})
    event_delivery_s: float = Field(
        30.0, ge=0, le=600, description="seconds to keep trying to deliver the published event while the Prefect "
                                        "API does not confirm it (then the result says event_delivered: false)",
        json_schema_extra={"flag": "--event-delivery-seconds"})
    retries: int = Field(3, ge=0, le=20,
                         description="retries of the upload and record write after a transient failure")
    retry_delay_s: float = Field(10.0, ge=0, le=3600,
                                 description="wait before the first publication retry, doubled for each next one",
                                 json_schema_extra={"flag": "--retry-delay"})
    stage_retries: int = Field(2, ge=0, le=20, description="deprecated, no effect: the upload stage runs once (its "
                                                           "requests retry, the whole publication retries: retries)")
    stage_retry_delay_s: float = Field(1.0, ge=0, le=3600, description="deprecated, no effect (see stage_retries)",
                                       json_schema_extra={"flag": "--stage-retry-delay"})
    rank: int | None = Field(None, ge=0, description="this trainer rank's index, when several ranks publish one "
                                                      "revision together (with --world-size and --publication)")
    world_size: int | None = Field(None, ge=1, le=65536, description="how many ranks publish the revision "
                                                                    "together (each its own tensors)")
    publication: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
                                    description="an id every rank of one publication shares, new for each "
                                                "(e.g. the run id and the step); rank 0 publishes the revision "
                                                "once every rank's part is there")
    part_timeout_s: float = Field(600.0, gt=0, description="how long a rank waits for the plan, the other "
                                                           "ranks' parts and the record",
                                   json_schema_extra={"flag": "--part-timeout"})
    signing_key: Path | None = Field(
        None, description="Ed25519 private key file that signs every catalog record this publisher writes (PEM, "
                          "OpenSSH or 32 bytes of base64; `python -m flows.publish keygen --out DIR` makes a pair; "
                          "docs/format.md, 4.10); without, records are unsigned")
    storage: ObjectStoreSettings = Field(default_factory=ObjectStoreSettings, json_schema_extra={
        "flags": {"concurrency": "--upload-workers", "endpoint_url": "--s3-endpoint-url"}})

    def publication_retry_policy(self) -> RetryPolicy:
        """Retries of the whole upload and record write after a transient failure."""
        return RetryPolicy(self.retries + 1, self.retry_delay_s, 2.0)

    @field_validator("catalog", "payload_url")
    @classmethod
    def _url_form(cls, value: str | None) -> str | None:
        return None if value is None else _valid_url(value)

    @field_validator("signing_key")
    @classmethod
    def _signing_key_load(cls, value: Path | None) -> Path | None:
        if value is not None:
            from storage.keys import load_private_key

            load_private_key(value)  # a ValueError naming the file, before anything is published
        return value

    @model_validator(mode="after")
    def _payload_beside_the_catalog(self) -> "PublishParams":
        from storage.urls import storage_kind

        if self.payload_url is not None and storage_kind(self.payload_url) != storage_kind(self.catalog):
            raise ValueError(f"payload_url {self.payload_url!r} is not in the catalog's kind of storage "
                             f"({storage_kind(self.catalog)}://): receivers refuse such records")
        return self

    @model_validator(mode="after")
    def _one_rank_of_a_publication(self) -> "PublishParams":
        given = [self.rank is not None, self.world_size is not None, self.publication is not None]
        if any(given) and not all(given):
            raise ValueError("a rank of a sharded publication needs rank, world_size and publication together")
        if all(given) and self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")
        return self

    @property
    def bucket_max_bytes(self) -> int:
        return self.bucket_max_mib * MIB


class RecoverParams(Settings):
    """Parameters of a recovery (env prefix ``CANONICAL_REFIT_``, like a refit's)."""

    model_config = settings_config("CANONICAL_REFIT_")

    model: str = Field(..., pattern=MODEL_PATTERN, description="model id, e.g. org/name")
    cache_dir: Path = Field(DEFAULT_CACHE_DIR, description="root of the local checkpoint store")
    lock_timeout_s: float = Field(3600.0, gt=0, description="longest wait for another receiver's lock",
                                  json_schema_extra={"flag": "--lock-timeout"})
    installer: InstallerSettings | None = Field(
        None, description="installer to re-install through (default: the one recorded when the node was poisoned)",
        json_schema_extra={"flags": {"kind": "--installer", "engine_urls": "--engine-url"}})
    override_installer: bool = Field(
        False, description="re-install through `installer` even though the node was poisoned through another")
    catalog: str | None = Field(None, description="the node's catalog URL: given, a recovery rewrites the node's "
                                                  "status record there at once (else at the agent's next beat)")
    node: str | None = Field(None, pattern=NODE_PATTERN,
                             description="this node's name in the fleet view (default: the host name)")
    storage: ObjectStoreSettings = Field(default_factory=ObjectStoreSettings, json_schema_extra={
        "flags": {"endpoint_url": "--s3-endpoint-url"}})
