"""Hostile revisions published next to good ones, and a store to throw them at.

``HostileWorld`` publishes (through the real publish flow) the launch
revision r0, a dense delta r1, and three templates on base r1: ``d2`` (dense
xor), ``s2`` (xor_sparse) and ``o2`` (overwrite). A store at r1 (installed,
materialized) is prepared once. Each hostile case copies a template to a new
version ``hN``, breaks one thing (record, index, bucket header, frame,
sparse record), and refits a fresh copy of the store to ``hN`` in-process
with the stage functions in flow order, under ``tracemalloc``.

``protected(store)`` is what a rejection must leave bit-for-bit unchanged:
the checkpoint folders, the verified records, ``active.json`` and
``state.json`` (its write time aside). The artifact cache (``deltas/``) and
the catalog memo are caches and may gain entries.
"""

from __future__ import annotations

import hashlib
import itertools
import gc
import json
import shutil
import struct
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

import tests.support.crash_support as cs
import tests.support.crash_trials as ct

MEMORY_BOUND = 48 * 2**20  # bytes a rejected refit of the tiny model may allocate at its peak


def protected(store: Path) -> dict[str, str]:
    """Content hashes of what a rejected input must not change."""
    out = {}
    for path in sorted(Path(store).rglob("*")):
        rel = path.relative_to(store)
        if not path.is_file() or rel.parts[0] in ("deltas", "catalog", "tmp") or path.name == "lock":
            continue
        data = path.read_bytes()
        if rel.name == "state.json":
            value = json.loads(data)
            value.pop("updated_at_unix_ms", None)
            data = json.dumps(value, sort_keys=True).encode()
        out[str(rel)] = hashlib.sha256(data).hexdigest()
    return out


def checkpoint_content(store: Path, version: str) -> dict[str, str]:
    """Content hashes of the files of ``version``'s verified checkpoint (wherever it lives now)."""
    record = json.loads((Path(store) / "verified" / f"{version}.json").read_text())
    folder = Path(store) / record["path"]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@dataclass
class Outcome:
    """What one hostile refit did."""

    version: str
    error: BaseException | None
    peak_bytes: int
    before: dict
    after: dict
    store: Path
    content_before: dict = field(default_factory=dict)
    content_after: dict = field(default_factory=dict)


class HostileWorld:
    """Templates, a store at r1, and a factory of hostile revisions."""

    def __init__(self, root: Path):
        from tests.support.lab import Lab, tiny_shape

        self.root = Path(root)
        self.lab = lab = Lab(self.root / "lab", shape=tiny_shape())
        lab.publish("initial")
        lab.publish("delta")
        r1 = lab.trainer / f"step-{lab.step}"
        base = lab.expected("r1")
        lab.publish("delta", lab.next_step(), version="d2", base_version="r1", base_checkpoint=r1)
        for version, encoding in (("s2", "xor_sparse"), ("o2", "overwrite")):
            lab.current = base
            lab.publish("delta", lab.next_step(fraction=0.01), version=version, base_version="r1",
                        base_checkpoint=r1, encoding=encoding)
        self.revisions = lab.catalog_dir.parent / "revisions"
        self.world = ct.World(self.root, lab)
        self.golden = self.root / "golden"
        out = self.world.children.run(self.world.job(self.golden, "r1"))
        assert out["status"] == "READY", out
        self._ids = itertools.count(1)

    @property
    def model_folder(self) -> str:
        return self.lab.model.replace("/", "--")

    # -- making hostile revisions ------------------------------------------------------------------

    def record(self, template: str) -> dict:
        return json.loads((self.lab.catalog_dir / f"{template}.json").read_text())

    def index(self, template: str) -> dict:
        uri = self.record(template)["uri"]
        return json.loads(Path(uri.removeprefix("file://")).read_bytes())

    def bucket_names(self, template: str) -> list[str]:
        return sorted(set(self.index(template)["weight_map"].values()))

    def new(self, template: str = "d2", *, record=None, index=None, files: dict | None = None,
            raw_record: bytes | None = None) -> str:
        """A copy of ``template`` as ``hN``; ``record``/``index``: dict -> dict edits (or raw bytes)."""
        version = f"h{next(self._ids)}"
        folder = self.revisions / version
        shutil.copytree(self.revisions / template, folder)
        rec = self.record(template)
        idx_name = Path(rec["uri"]).name
        idx = self.index(template)
        idx["metadata"]["version"] = version
        idx = index(idx) if callable(index) else idx
        (folder / idx_name).write_bytes(idx if isinstance(idx, bytes) else json.dumps(idx).encode())
        for name, data in (files or {}).items():
            (folder / name).write_bytes(data(folder / name) if callable(data) else data)
        rec["version"] = version
        rec["uri"] = f"file://{folder / idx_name}"
        rec = record(rec) if callable(record) else rec
        body = raw_record if raw_record is not None else (rec if isinstance(rec, bytes) else json.dumps(rec).encode())
        (self.lab.catalog_dir / f"{version}.json").write_bytes(body)
        return version

    # -- throwing them at the store -----------------------------------------------------------------

    def refit(self, version: str, *, name: str | None = None) -> Outcome:
        """Refit a fresh copy of the r1 store to ``version`` in this process, measuring peak memory."""
        from flows.refit import run_refit
        from storage.errors import RefitError
        from storage.settings import RefitParams

        cache = self.root / "cases" / (name or version)
        if cache.exists():
            shutil.rmtree(cache)
        shutil.copytree(self.golden, cache, symlinks=True)
        store = cache / self.model_folder
        before, content_before = protected(store), checkpoint_content(store, "r1")
        # the launch revision is named: finding it by listing would read every hostile record of the catalog
        params = RefitParams(catalog=self.lab.catalog, model=self.lab.model, seed_checkpoint=str(self.lab.launch),
                             cache_dir=cache, target=version, initial_version="r0", apply_workers=2,
                             lock_timeout_s=30)
        engine = cs.RecordingEngine(cache / "engine.json")
        error = None
        tracemalloc.start()
        try:
            result = run_refit(params, installer=engine)
            error = result.exception
            assert error is None or isinstance(error, RefitError), f"untyped error: {error!r}"
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        after = protected(store)
        content_after = checkpoint_content(store, "r1") if (store / "verified" / "r1.json").exists() else {}
        return Outcome(version, error, peak, before, after, store, content_before, content_after)


# --- bucket and frame surgery ------------------------------------------------------------------------------


def read_bucket(path: Path) -> tuple[dict, dict, dict[str, bytes]]:
    """(metadata, tensor entries, {tensor: frame bytes}) of a delta bucket."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    metadata = header.pop("__metadata__", {})
    frames = {k: data[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]] for k, v in header.items()}
    return metadata, header, frames


def write_bucket(metadata: dict, frames: dict[str, bytes]) -> bytes:
    """A bucket file holding ``frames`` as 1-D U8 tensors, in order."""
    header, offset, body = {"__metadata__": metadata}, 0, b""
    for name, frame in frames.items():
        header[name] = {"dtype": "U8", "shape": [len(frame)], "data_offsets": [offset, offset + len(frame)]}
        offset += len(frame)
        body += frame
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def replace_frame(tensor: str, make, *, checksum: str | None = None):
    """A ``files`` edit: the bucket with ``tensor``'s frame replaced by ``make(old_frame)``."""
    def edit(path: Path) -> bytes:
        metadata, _, frames = read_bucket(path)
        if tensor in frames:
            frames[tensor] = make(frames[tensor])
            if checksum is not None:
                metadata[tensor] = checksum
        return write_bucket(metadata, frames)
    return edit


def decoded(frame: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(frame, max_output_size=1 << 26)


def compress(data: bytes, *, content_size: bool = True) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=content_size).compress(data)


def raw_frame(blocks: list[tuple[int, int, bytes]], *, content_size: int | None = None, window_log: int = 20) -> bytes:
    """A hand-made zstd frame: ``blocks`` of (type, size, payload); RLE = type 1 with a 1-byte payload."""
    out = struct.pack("<I", 0xFD2FB528)
    if content_size is None:
        out += bytes([0x00, (window_log - 10) << 3])  # no content size, window descriptor
    else:
        out += bytes([0xE0]) + struct.pack("<Q", content_size)  # 8-byte content size, single segment
    for i, (kind, size, payload) in enumerate(blocks):
        last = 1 if i == len(blocks) - 1 else 0
        header = last | (kind << 1) | (size << 3)
        out += header.to_bytes(3, "little") + payload
    return out


def frame_tensor(world: HostileWorld, template: str = "d2") -> tuple[str, str, int]:
    """(bucket file, tensor, byte size) of the largest tensor in the template's first bucket."""
    bucket = world.bucket_names(template)[0]
    _, entries, frames = read_bucket(world.revisions / template / bucket)
    sizes = {n: len(decoded(f)) for n, f in frames.items()} if template == "d2" else None
    name = max(frames, key=lambda n: len(frames[n]))
    nbytes = sizes[name] if sizes else tensor_nbytes(world, name)
    return bucket, name, nbytes


def tensor_nbytes(world: HostileWorld, name: str) -> int:
    return world.lab.expected("r1")[name].nbytes


# --- one world per test process, and the checks every rejection must pass -----------------------------------

_WORLD: HostileWorld | None = None


def hostile_world(tmp_path_factory) -> HostileWorld:
    """The process-wide ``HostileWorld`` (publishing it once costs a few Prefect flow runs)."""
    global _WORLD
    if _WORLD is None:
        _WORLD = HostileWorld(tmp_path_factory.mktemp("hostile"))
    return _WORLD


def assert_rejected(out: Outcome, kind: type, *, tensor: str | None = None, file: str | None = None,
                    late: bool = False, bound: int = MEMORY_BOUND) -> None:
    """``out`` failed with ``kind`` naming revision, file and tensor, and left the store as it was.

    Early rejections (before the store went UPDATING) leave the protected part
    of the store bit-for-bit unchanged. A late one (corrupt compressed bytes,
    a wrong checksum: found only while patching in place) must restore the
    installed version: same bytes, READY, and an installed identity naming the
    rebuilt files.
    """
    err = out.error
    assert isinstance(err, kind), f"expected {kind.__name__}, got {type(err).__name__}: {err}"
    assert err.revision == out.version, err
    assert err.file, err
    if file is not None:
        assert err.file.endswith(file), err
    if tensor is not None:
        assert err.tensor == tensor, err
    assert out.peak_bytes < bound, f"peak {out.peak_bytes:,} bytes"
    assert gc.isenabled(), "the refit left Python's garbage collector paused"
    assert out.content_after == out.content_before, "the installed version's bytes changed"
    store = out.store
    engine = cs.RecordingEngine(store.parent / "engine.json")
    assert [load["version"] for load in engine.loads()] == ["r1"], "the engine was handed something"
    if not late:
        assert not err.mutation_started, err
        assert out.after == out.before, sorted(k for k in set(out.before) | set(out.after)
                                              if out.before.get(k) != out.after.get(k))
        return
    state = json.loads((store / "state.json").read_text())
    verified = json.loads((store / "verified" / "r1.json").read_text())
    active = json.loads((store / "active.json").read_text())
    assert (state["status"], state["version"], state["source"]) == ("READY", "r1", verified["path"])
    assert cs._identity(store / verified["path"]) == verified["files"] == state["files"]
    assert (active["version"], active["path"], active["files"]) == ("r1", verified["path"], verified["files"])
    # the records of r1 were rewritten by the rollback (and its write-back marks them flushed when it is done)
    records = ("verified/", "flushed/", "state.json", "active")
    before_active = {k: v for k, v in out.before.items() if not k.startswith(records)}
    after_active = {k: v for k, v in out.after.items() if not k.startswith(records)}
    assert after_active == before_active, sorted(k for k in set(before_active) | set(after_active) if before_active.get(k) != after_active.get(k))  # no other checkpoint appeared, vanished or changed


def accepted_or_rejected(out: Outcome, target_tensors) -> str:
    """For fuzzed inputs: a typed rejection that kept the store, or an install of exactly the target."""
    from storage.errors import RefitError

    if out.error is None:
        store = out.store
        verified = json.loads((store / "verified" / f"{out.version}.json").read_text())
        got = cs.raw_tensors(store / verified["path"])
        assert {k: v[2] for k, v in got.items()} == {k: a.tobytes() for k, a in target_tensors.items()}
        return "accepted"
    assert isinstance(out.error, RefitError)
    assert_rejected(out, type(out.error), late=out.error.mutation_started)
    return "rejected"
