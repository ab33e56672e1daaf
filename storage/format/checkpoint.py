"""A local Hugging Face safetensors checkpoint: where each tensor lives, and its digests."""

from __future__ import annotations

import os
import stat
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Mapping

from storage.jsonio.bounded_json import INDEX, load_json, read_bounded
from storage.format.digests import checksum_bytes, format_digest, new_checksum, snapshot_digest
from storage.errors import CheckpointMismatch, ManifestError, SafetensorsError
from storage.format.mapped import MappedFiles
from storage.runtime.gc_pause import gc_paused_call
from storage.format.safetensors import SafetensorsHeader, header_length, parse_header

INDEX_FILE = "model.safetensors.index.json"
HASH_BLOCK = 8 * 2**20


@dataclass(frozen=True)
class TensorLocation:
    """One tensor of a checkpoint: file name, absolute byte offset, size, dtype and shape."""

    name: str
    file: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def check_shard_name(name: object, *, revision: str | None = None, file: str | None = None,
                     tensor: str | None = None) -> str:
    """A weight-map file name must be a bare ``*.safetensors`` base name (docs/format.md, section 5)."""
    if type(name) is str and name in _SAFE_SHARD_NAMES:  # a weight map names each of its few shards per tensor
        return name
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or name.startswith(".")
        or not name.endswith(".safetensors")
        or name == ".safetensors"
    ):
        raise ManifestError(f"unsafe shard file name {name!r}", revision=revision, file=file, tensor=tensor)
    if len(_SAFE_SHARD_NAMES) < 4096:
        _SAFE_SHARD_NAMES.add(name)
    return name


_SAFE_SHARD_NAMES: set[str] = set()  # names already accepted (strings only: a set member is hashable and equal)


class TensorTable:
    """What a checkpoint's table of tensors (``self.tensors``: name -> ``TensorLocation``) tells by itself."""

    tensors: dict[str, TensorLocation]

    def layout(self) -> dict[str, tuple[str, tuple[int, ...], int]]:
        """``{name: (dtype, shape, nbytes)}``, the part two checkpoints must share for a delta."""
        return {t.name: (t.dtype, t.shape, t.nbytes) for t in self.tensors.values()}

    def format_digest(self) -> str:
        return format_digest((t.name, t.dtype, t.shape) for t in self.tensors.values())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


class CheckpointIndex(TensorTable):
    """Tensor locations of a checkpoint folder (its index file, or every ``*.safetensors``)."""

    def __init__(self, folder: Path, tensors: Mapping[str, TensorLocation], headers: Mapping[str, SafetensorsHeader]):
        self.folder = Path(folder)
        self.tensors = dict(tensors)
        self.headers = dict(headers)

    @classmethod
    @gc_paused_call  # a location a tensor, no cycles
    def open(cls, folder: Path, *, revision: str | None = None) -> "CheckpointIndex":
        """Parse and check the folder's index and every shard's header.

        A refit opens the same layout several times (the seed, the base, the
        patched target, the verification): what was parsed from given index and
        header bytes is remembered (``_Parsed``), so opening a folder whose
        index and headers are byte for byte ones already parsed only reads
        them — O(shards), not O(tensors) of JSON. Only successes are kept, keyed
        by the bytes themselves, so a file that changed is parsed again.
        """
        folder = Path(folder)
        if not folder.is_dir():
            raise SafetensorsError("checkpoint folder does not exist", file=str(folder), revision=revision)
        index_path = folder / INDEX_FILE
        unchanged = _PARSED.unchanged(folder, index_path)
        if unchanged is not None:
            return cls(folder, unchanged[0], unchanged[1])._sharing(unchanged[2])
        weight_map = index_bytes = None
        index_id = _identity(index_path)  # taken before the bytes are read: a later change makes it differ
        if index_id is not None:
            index_bytes = read_bounded(index_path, INDEX, error=ManifestError, file=str(index_path),
                                       revision=revision)
            weight_map, files = _PARSED.weight_map(index_bytes, index_path, revision)
        else:
            files = _shard_files(folder)
        if not files:
            raise SafetensorsError("no safetensors files in checkpoint", file=str(folder), revision=revision)
        read = [(name, *_raw_header(folder / name, revision)) for name in files]
        raw_headers = [(name, size, header_bytes) for name, size, header_bytes, _ in read]
        identities = (index_id, tuple((name, identity) for name, _, _, identity in read))
        key = (index_bytes, tuple(raw_headers))
        known = _PARSED.layouts.get(key)
        if known is not None:
            _PARSED.layouts.move_to_end(key)
            _PARSED.note(folder, identities, known)
            return cls(folder, known[0], known[1])._sharing(known[2])
        headers, tensors = {}, {}
        for name, size, header_bytes in raw_headers:
            path = folder / name
            header = parse_header(header_bytes, len(header_bytes), size, file=str(path), revision=revision)
            headers[name] = header
            offset = header.data_offset
            new = object.__new__
            for info in header.tensors.values():
                if info.name in tensors:
                    raise SafetensorsError(
                        f"tensor appears in two shards ({tensors[info.name].file} and {name})",
                        file=str(path), tensor=info.name, revision=revision,
                    )
                if weight_map is not None and weight_map.get(info.name) != name:
                    raise SafetensorsError(
                        f"tensor is in {name} but the index maps it to {weight_map.get(info.name)!r}",
                        file=str(index_path), tensor=info.name, revision=revision,
                    )
                # ``TensorLocation(...)`` without the frozen dataclass's per-field setattr (one per tensor)
                location = tensors[info.name] = new(TensorLocation)
                location.__dict__.update(name=info.name, file=name, offset=offset + info.start,
                                         nbytes=info.end - info.start, dtype=info.dtype, shape=info.shape)
        if weight_map is not None and len(weight_map) != len(tensors):
            for tensor, name in weight_map.items():
                if tensor not in tensors:
                    raise SafetensorsError(
                        f"index maps the tensor to {name} but that shard does not hold it",
                        file=str(index_path), tensor=tensor, revision=revision,
                    )
        memo: dict = {}  # what every index opened from these bytes computes once (its format digest)
        _PARSED.remember(key, (tensors, headers, memo))
        _PARSED.note(folder, identities, (tensors, headers, memo))
        return cls(folder, tensors, headers)._sharing(memo)

    def _sharing(self, memo: dict) -> "CheckpointIndex":
        self._memo = memo
        self._memo_tensors = len(self.tensors)
        return self

    def format_digest(self) -> str:
        """The layout's digest, computed once per layout parsed from the same bytes (while ``tensors`` is
        the table it was opened with)."""
        return self._remembered("format_digest", super().format_digest)

    def layout(self) -> Mapping[str, tuple[str, tuple[int, ...], int]]:
        """``TensorTable.layout``, made once per layout parsed from the same bytes (read-only: it is shared)."""
        return self._remembered("layout", lambda: MappingProxyType(super(CheckpointIndex, self).layout()))

    def _remembered(self, what: str, compute: Callable):
        """``compute()``, once per layout parsed from the same bytes while ``tensors`` is the table it was opened
        with (else computed each time)."""
        memo = getattr(self, "_memo", None)
        if memo is None or len(self.tensors) != self._memo_tensors:
            return compute()
        value = memo.get(what)
        if value is None:
            value = memo[what] = compute()
        return value

    @gc_paused_call  # a checksum a tensor: no cycles
    def checksums(
        self,
        checksum_format: str,
        *,
        names: list[str] | None = None,
        workers: int = 4,
        progress: Callable[[int], None] | None = None,
        stop=None,
    ) -> dict[str, str]:
        """Checksum of every tensor (or of ``names``), read through mmap in parallel, largest first.

        ``stop`` (a ``StopToken``) is checked between blocks.
        """
        wanted = [self.tensors[n] for n in (names if names is not None else self.tensors)]
        wanted.sort(key=lambda t: -t.nbytes)
        with MappedFiles(self.folder) as maps:
            def one(t: TensorLocation) -> tuple[str, str]:
                h = new_checksum(checksum_format)
                view = maps.array(t.file)
                for start in range(t.offset, t.offset + t.nbytes, HASH_BLOCK):
                    if stop is not None:
                        stop.check(file=str(self.folder / t.file), tensor=t.name)
                    end = min(t.offset + t.nbytes, start + HASH_BLOCK)
                    h.update(view[start:end])
                    if progress:
                        progress(end - start)
                if t.nbytes == 0:
                    h.update(b"")
                return t.name, h.hexdigest()

            def batch(group: list[TensorLocation]) -> list[tuple[str, str]]:
                if stop is not None:
                    stop.check(file=str(self.folder / group[0].file), tensor=group[0].name)
                out = []
                arrays: dict = {}  # shard name -> its mapping (looked up once a batch)
                for t in group:
                    if 0 < t.nbytes <= HASH_BLOCK:  # one block: one call (``stop`` was checked for the batch)
                        view = arrays.get(t.file)
                        if view is None:
                            view = arrays[t.file] = maps.array(t.file)
                        out.append((t.name, checksum_bytes(checksum_format, view[t.offset: t.offset + t.nbytes])))
                        if progress:
                            progress(t.nbytes)
                    else:
                        out.append(one(t))
                return out

            with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
                return dict(pair for done in pool.map(batch, _batches(wanted)) for pair in done)

    def snapshot_digest(self, checksum_format: str, checksums: Mapping[str, str]) -> str:
        return snapshot_digest(checksum_format, self.format_digest(), checksums)


BATCH_BYTES = 4 * 2**20  # small tensors go to the hashing threads in groups of about this many bytes
BATCH_TENSORS = 512


def _batches(tensors: list[TensorLocation]) -> list[list[TensorLocation]]:
    """Consecutive groups of ``tensors`` (in their order): a large tensor alone, small ones together, so a
    thread pool's hand-off (tens of microseconds) is paid per group, not per tiny tensor."""
    groups: list[list[TensorLocation]] = []
    group: list[TensorLocation] = []
    size = 0
    for t in tensors:
        group.append(t)
        size += t.nbytes
        if size >= BATCH_BYTES or len(group) >= BATCH_TENSORS:
            groups.append(group)
            group, size = [], 0
    if group:
        groups.append(group)
    return groups


def require_same_layout(
    expected: Mapping[str, tuple[str, tuple[int, ...], int]],
    actual: Mapping[str, tuple[str, tuple[int, ...], int]],
    *,
    revision: str | None,
    file: str | None,
) -> None:
    """Raise ``CheckpointMismatch`` naming the first tensor whose set, dtype, shape or size differ."""
    if expected == actual:  # the usual case, compared in one call; the walk below names a difference
        return
    for name in sorted(set(expected) | set(actual)):
        if name not in actual:
            raise CheckpointMismatch("tensor is missing", revision=revision, file=file, tensor=name)
        if name not in expected:
            raise CheckpointMismatch("tensor is not in the local checkpoint", revision=revision, file=file, tensor=name)
        (edt, esh, enb), (adt, ash, anb) = expected[name], actual[name]
        if edt != adt:
            raise CheckpointMismatch(f"dtype {adt} differs from local {edt}", revision=revision, file=file, tensor=name)
        if tuple(esh) != tuple(ash):
            raise CheckpointMismatch(f"shape {list(ash)} differs from local {list(esh)}",
                                     revision=revision, file=file, tensor=name)
        if enb != anb:
            raise CheckpointMismatch(f"byte size {anb} differs from local {enb}", revision=revision, file=file, tensor=name)


def _shard_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.safetensors") if not p.name.startswith("."))


def _identity(path: Path) -> tuple[int, ...] | None:
    """A file's identity (device, inode, size, modification and change times to the nanosecond); None if there is
    no file there."""
    try:
        info = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return _identity_of(info)


def _identity_of(info: os.stat_result) -> tuple[int, ...]:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns, stat.S_IFMT(info.st_mode))


def _raw_header(path: Path, revision: str | None) -> tuple[int, bytes, tuple[int, ...]]:
    """A shard's size, header bytes and identity (``_identity``, of the file read), the length prefix checked
    against the size and the bound first."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO never blocks
    except OSError:
        raise SafetensorsError("shard named by the index is missing", file=str(path), revision=revision) from None
    with open(fd, "rb") as fh:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SafetensorsError("shard named by the index is missing", file=str(path), revision=revision)
        n = header_length(fh.read(8), info.st_size, file=str(path), revision=revision)
        return info.st_size, fh.read(n), _identity_of(info)


class _Parsed:
    """What index and header bytes parsed to (successes only), the last two layouts, keyed by the bytes."""

    KEEP = 2  # a refit opens one layout (two at most, across a layout change); more would only hold memory

    def __init__(self) -> None:
        self.layouts: OrderedDict = OrderedDict()
        self.indexes: OrderedDict = OrderedDict()
        self.folders: OrderedDict = OrderedDict()  # folder -> (the identities of its files as read, the layout)
        self._lock = threading.Lock()

    def note(self, folder: Path, identities: tuple, value) -> None:
        """``folder``'s index and shards had ``identities`` (taken before their bytes were read) when they
        parsed to ``value``."""
        with self._lock:
            self.folders[str(folder)] = (identities, value)
            self.folders.move_to_end(str(folder))
            while len(self.folders) > 2 * self.KEEP:
                self.folders.popitem(last=False)

    def unchanged(self, folder: Path, index_path: Path):
        """What ``folder`` parsed to when it was last opened, if its index and every shard read then are the
        very files they were (``_identity``: same inode, size and times to the nanosecond; a shard list
        from a glob must list the same names): nothing is read again. None otherwise."""
        with self._lock:
            known = self.folders.get(str(folder))
        if known is None:
            return None
        (index_id, shards), value = known
        if _identity(index_path) != index_id:
            return None
        if index_id is None and [name for name, _ in shards] != _shard_files(folder):
            return None
        for name, identity in shards:
            if _identity(folder / name) != identity:
                return None
        return value

    def remember(self, key, value) -> None:
        with self._lock:
            self.layouts[key] = value
            while len(self.layouts) > self.KEEP:
                self.layouts.popitem(last=False)

    def weight_map(self, raw: bytes, index_path: Path, revision: str | None) -> tuple[dict[str, str], list[str]]:
        known = self.indexes.get(raw)
        if known is None:
            weight_map = _read_weight_map(raw, index_path, revision)
            known = (weight_map, sorted(set(weight_map.values())))
            with self._lock:
                self.indexes[raw] = known
                while len(self.indexes) > self.KEEP:
                    self.indexes.popitem(last=False)
        return known


_PARSED = _Parsed()


def _read_weight_map(data: bytes, index_path: Path, revision: str | None) -> dict[str, str]:
    label = str(index_path)
    raw = load_json(data, INDEX, error=ManifestError, expect=dict, file=label, revision=revision)
    weight_map = raw.get("weight_map")
    if not isinstance(weight_map, dict):
        raise ManifestError("index has no weight_map object", file=label, revision=revision)
    for tensor, name in weight_map.items():
        check_shard_name(name, revision=revision, file=label, tensor=tensor)
    return weight_map
