"""One delta bucket checked before its bytes are used, and the plan objects made of it.

``bucket_steps`` checks a downloaded bucket (header, metadata, target checksums,
each frame's structure and declared size: nothing is decompressed) and returns a
``PatchStep`` per tensor; ``TensorPlan`` groups one tensor's steps, oldest
revision first. The frames of the common shape (one single-segment zstd frame
of one block declaring its tensor's size) and the checksums are checked for the
whole bucket in a few array operations; any other frame one by one
(``check_frame``), which names the problem.
"""

from __future__ import annotations

import re
from operator import attrgetter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Mapping

import numpy as np

from storage.catalog.manifests import Manifest
from storage.errors import ManifestError
from storage.format.checkpoint import TensorLocation
from storage.format.codec import ValidatedFrame, check_frame
from storage.format.digests import CHECKSUM_HEX_LENGTH, is_checksum
from storage.format.frames import plain_xor_frames
from storage.format.mapped import MappedFiles
from storage.format.safetensors import HeaderTensors, SafetensorsHeader, read_header
from storage.runtime.gc_pause import gc_paused_call


@dataclass(frozen=True)
class PatchStep:
    """One revision's frame for one tensor: where it lies and what it must hash to."""

    revision: str
    encoding: str
    bucket: Path
    bucket_uri: str
    start: int
    end: int
    checksum: str
    checksum_format: str
    validated: ValidatedFrame | None = None  # what bucket_steps checked of the frame (its structure)

    def context(self, tensor: str) -> dict:
        return {"revision": self.revision, "file": self.bucket_uri, "tensor": tensor}


@dataclass(frozen=True)
class TensorPlan:
    """Every step to apply to one tensor, oldest revision first."""

    location: TensorLocation
    steps: tuple[PatchStep, ...]


def tensor_plan(location: TensorLocation, steps: tuple[PatchStep, ...]) -> TensorPlan:
    """``TensorPlan(location, steps)`` without the frozen dataclass's per-field ``object.__setattr__``."""
    plan = object.__new__(TensorPlan)
    plan.__dict__.update(location=location, steps=steps)
    return plan


@gc_paused_call  # a step per tensor (the collector would walk the whole index again and again)
def bucket_steps(manifest: Manifest, bucket: str, path: Path,
                 checkpoint: Mapping[str, TensorLocation], *, workers: int = 1) -> dict[str, PatchStep]:
    """Check one downloaded bucket and return its frame for each tensor: header, metadata, target checksums,
    and each frame's structure and declared size (``check_frame``: no decompression; the records are validated
    as they are decoded to be applied). ``workers`` threads check the frames (the first bad one in name order is
    the error raised)."""
    uri = manifest.file_url(bucket)
    version = manifest.version
    header = read_header(path, revision=version, file=uri)
    expected = set(manifest.tensors_of(bucket))
    for name in sorted(header.tensors.keys() - expected):
        raise ManifestError("bucket holds a tensor its index does not map to it", revision=version, file=uri,
                            tensor=name)
    if expected and not header.metadata:
        raise ManifestError("bucket has no __metadata__ with target checksums", revision=version, file=uri)
    columns = _plain_columns(header, expected, checkpoint, manifest.checksum_format)
    if columns is None:  # something is off (or a header not laid out in order): row by row, for the error
        rows = _rows(header, expected, checkpoint, manifest.checksum_format, version=version, uri=uri)
        columns = ([r[0] for r in rows], np.array([r[1] for r in rows], np.int64),
                   np.array([r[2] for r in rows], np.int64), [r[3] for r in rows])
    steps = _frame_steps(manifest, path, uri, *columns, checkpoint, workers)
    return dict(zip(columns[0], steps))


def _plain_columns(header: SafetensorsHeader, expected: set[str], checkpoint: Mapping[str, TensorLocation],
                   fmt: str) -> tuple[list[str], np.ndarray, np.ndarray, list[str]] | None:
    """``(names, frame starts, frame ends, checksums)`` in the header's order when it holds exactly the
    ``expected`` tensors (``bucket_steps`` refused any other already), all in the checkpoint, all 1-D ``U8``,
    with a well formed checksum each: shown for the whole bucket from the header's columns
    (``HeaderTensors``), no object a tensor; None otherwise (``_rows`` then names the problem)."""
    tensors = header.tensors
    if not isinstance(tensors, HeaderTensors) or len(tensors) != len(expected):
        return None
    names = list(tensors)
    if not all(map(checkpoint.__contains__, names)) or set(tensors.dtypes()) != {"U8"} \
            or set(map(len, tensors.shapes())) != {1}:
        return None
    checksums = _plain_checksums(fmt, header.metadata, names)
    if checksums is None:
        return None
    offset = header.data_offset
    return names, tensors.starts + offset, tensors.ends + offset, checksums


def _rows(header: SafetensorsHeader, expected: set[str], checkpoint: Mapping[str, TensorLocation], fmt: str, *,
          version: str, uri: str) -> list[tuple[str, int, int, str]]:
    """``(tensor, frame start, frame end, checksum)`` of each expected tensor, in name order; raises a
    ``ManifestError`` naming the first (in name order) that is missing, unknown, not 1-D U8, or without a well
    formed checksum. When all is well (the common case) it is shown for the whole bucket in a few set and
    list operations; otherwise the tensors are checked one by one, for the error."""
    tensors, metadata, data_offset = header.tensors, header.metadata, header.data_offset
    plain = _plain_checksums(fmt, metadata, expected) is not None  # every checksum well formed (one match)
    names = sorted(expected)
    if plain and expected <= tensors.keys() and all(name in checkpoint for name in names):
        infos = [tensors[name] for name in names]
        if all(info.dtype == "U8" and len(info.shape) == 1 for info in infos):
            return [(name, data_offset + info.start, data_offset + info.end, metadata[name])
                    for name, info in zip(names, infos)]
    rows: list[tuple[str, int, int, str]] = []
    for name in names:
        info = tensors.get(name)
        if info is None:
            raise ManifestError("tensor named by the index is missing from its bucket", revision=version,
                                file=uri, tensor=name)
        if name not in checkpoint:
            raise ManifestError("bucket holds a tensor the local checkpoint does not have", revision=version,
                                file=uri, tensor=name)
        if info.dtype != "U8" or len(info.shape) != 1:
            raise ManifestError(f"delta tensor must be 1-D U8, found {info.dtype} {list(info.shape)}",
                                revision=version, file=uri, tensor=name)
        checksum = metadata.get(name)
        if checksum is None:
            raise ManifestError("bucket metadata has no checksum for the tensor", revision=version, file=uri,
                                tensor=name)
        if not plain and not is_checksum(fmt, checksum):
            raise ManifestError(f"checksum {checksum!r} is not a {fmt} checksum",
                                revision=version, file=uri, tensor=name)
        start = data_offset + info.start
        rows.append((name, start, start + info.nbytes, checksum))
    return rows


def _frame_steps(manifest: Manifest, path: Path, uri: str, names: list[str], starts: np.ndarray, ends: np.ndarray,
                 checksums: list[str], checkpoint: Mapping[str, TensorLocation], workers: int) -> list[PatchStep]:
    """Each tensor's step, its frame's structure checked: dense frames of the common shape for the whole bucket at
    once (``plain_xor_frames``), the others one by one (``check_frame``, in name order), by ``workers`` threads."""
    version, fmt = manifest.version, manifest.checksum_format
    encoding = manifest.delta_encoding
    with MappedFiles(path.parent) as maps:
        data = maps.array(path.name)

        def validated(row: tuple[str, int, int, str]) -> PatchStep:
            # the frame's headers and declared size, nothing decompressed: the apply pass decodes it once
            name, start, end, checksum = row
            frame = check_frame(encoding, memoryview(data[start:end]), checkpoint[name].nbytes,
                                revision=version, file=uri, tensor=name)
            return _patch_step(version, encoding, path, uri, start, end, checksum, fmt, frame)

        steps: list[PatchStep | None] = [None] * len(names)
        slow = range(len(names))
        if encoding == "xor" and names:  # the common frame shape, checked for the whole bucket at once
            sizes = np.fromiter(map(_NBYTES, map(checkpoint.__getitem__, names)), np.int64, len(names))
            plain_frames = plain_xor_frames(data, starts, ends, sizes)
            slow = np.flatnonzero(~plain_frames).tolist()
            plain = np.flatnonzero(plain_frames)
            common = {"revision": version, "encoding": encoding, "bucket": path, "bucket_uri": uri,
                      "checksum_format": fmt}
            made = _xor_steps(common, starts[plain].tolist(), ends[plain].tolist(),
                              [checksums[i] for i in plain.tolist()], sizes[plain].tolist())
            for i, step in zip(plain.tolist(), made):
                steps[i] = step
        slow = sorted(slow, key=names.__getitem__)  # the first bad frame in name order is the error raised
        starts_of, ends_of = starts.tolist(), ends.tolist()
        todo = [(names[i], starts_of[i], ends_of[i], checksums[i]) for i in slow]
        if workers > 1 and len(todo) > 1:
            groups = _groups(todo)  # tiny frames go to a thread together: one future per group, not per tensor

            def validate_group(group: list[tuple[str, int, int, str]]) -> list[PatchStep]:
                return [validated(row) for row in group]

            with ThreadPoolExecutor(min(workers, len(groups)), thread_name_prefix="validate") as pool:
                # the groups' results in order: raises the first failure in name order
                done = [step for group in pool.map(validate_group, groups) for step in group]
        else:
            done = [validated(row) for row in todo]
        for i, step in zip(slow, done):
            steps[i] = step
    return steps


def _xor_steps(common: dict, starts: list[int], ends: list[int], checksums: list[str],
               sizes: list[int]) -> list[PatchStep]:
    """A ``PatchStep`` (``common`` fields and each frame's bounds and checksum) with its ``ValidatedFrame("xor",
    size, frame size)`` for each frame ``plain_xor_frames`` proved, each made as one dictionary (not the frozen
    dataclasses' ``object.__setattr__`` per field: a bucket holds 100k of them)."""
    new, put, xor = object.__new__, object.__setattr__, _XOR_FRAME
    out = []
    for start, end, checksum, n in zip(starts, ends, checksums, sizes):
        frame = new(ValidatedFrame)
        put(frame, "__dict__", {**xor, "nbytes": n, "frame_size": end - start})
        step = new(PatchStep)
        put(step, "__dict__", {**common, "start": start, "end": end, "checksum": checksum, "validated": frame})
        out.append(step)
    return out


def _plain_checksums(fmt: str, metadata: Mapping[str, str], names) -> list[str] | None:
    """The checksums of ``names`` in ``metadata`` when they are all there and well formed (one regular expression
    over them all); None leaves the check (and the error naming the tensor) to each one."""
    try:
        values = list(map(metadata.__getitem__, names))
    except KeyError:
        return None
    width = CHECKSUM_HEX_LENGTH[fmt]
    if not width or set(map(type, values)) - {str}:
        return None
    return values if re.fullmatch(f"(?:[0-9a-f]{{{width}}}\n)*", "".join(v + "\n" for v in values)) else None


def _patch_step(*values) -> PatchStep:
    """``PatchStep(*values)`` without the frozen dataclass's ``object.__setattr__`` per field (one step is made
    per tensor and delta)."""
    step = object.__new__(PatchStep)
    step.__dict__.update(zip(_STEP_FIELDS, values))
    return step


_STEP_FIELDS = tuple(f.name for f in fields(PatchStep))
_XOR_FRAME = {"encoding": "xor", "count": None, "ordered": True, "positions_bytes": None, "complete": True}
_NBYTES = attrgetter("nbytes")
VALIDATE_GROUP_BYTES, VALIDATE_GROUP_TENSORS = 2**20, 256


def _groups(rows: list[tuple[str, int, int, str]]) -> list[list[tuple[str, int, int, str]]]:
    """Consecutive rows, in groups of under ``VALIDATE_GROUP_BYTES`` of frames (a larger frame alone)."""
    groups: list[list[tuple[str, int, int, str]]] = []
    group: list[tuple[str, int, int, str]] = []
    size = 0
    for row in rows:
        frame = row[2] - row[1]
        if group and (size + frame > VALIDATE_GROUP_BYTES or len(group) >= VALIDATE_GROUP_TENSORS):
            groups.append(group)
            group, size = [], 0
        group.append(row)
        size += frame
    if group:
        groups.append(group)
    return groups
