"""The install pause: the in-engine loader against a plain parallel copy of the same bytes into a torch module.

    python -m benchmarks.install                       # ~1 GB bf16 model, best of 3, on the CPU
    python -m benchmarks.install --quick               # 64 MB
    python -m benchmarks.install --device cuda         # into GPU parameters
    python -m benchmarks.install --torch-threads 1     # each copy_ on one thread, as a GPU engine copies host memory

A bf16 transformer-shaped checkpoint (``benchmarks._model.shape_for``) is
published as r0 and prepared by the refit runbook (installer ``none``) into a
receiver store, READY, as a node holds it when the ``sglang`` installer calls
the engine. A torch module on ``--device`` has parameters with the
checkpoint's names, shapes and dtype. With the checkpoint in the page cache
(read once first), best of ``--repeat``:

- the reference: each shard mapped, every tensor a ``torch.frombuffer`` view,
  ``param.copy_(view)`` on ``--threads`` threads: a plain copy of the bytes;
- the loader as the engine runs it: ``load_prepared_checkpoint(model, [])``
  end to end (the request, the store's shared lock, validation, reports),
  with a stand-in for SGLang's ``DefaultModelLoader`` (absent here) whose
  ``load`` does what ``load_weights_and_postprocess`` does for a plain model,
  ``param.data.copy_(tensor)`` for each tensor, reading the files through
  SGLang's sequential ``safetensors_weights_iterator`` (mirrored), SGLang
  0.5.23's default ``buffered_multi_thread_safetensors_weights_iterator``
  (mirrored: one thread per shard), or the loader's own ``parallel_weights``.

Every run starts from zeroed parameters, and after its last run every
variant's parameters are checked bit for bit against the checkpoint. Goal: the loader, with its own
reader, within 1.3 x the reference's time. Writes JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import itertools
import mmap
import os
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from benchmarks._bench import bench_main
from testbed.processes import machine

SCHEMA = "canonical-refit.benchmark.install.v1"
MODEL = "bench/install"
GOAL_OVER_REFERENCE = 1.3
QUICK_MB = 64
READERS = {  # name -> what it mirrors
    "sequential": "SGLang's sequential safetensors_weights_iterator (safe_open per shard, one tensor after another)",
    "sglang_threads": "SGLang 0.5.23's default reader (buffered_multi_thread_safetensors_weights_iterator, "
                      "one thread per shard)",
    "parallel": "the loader's own parallel_weights (what SGLangDefaultLoader.weights returns)",
}


def log(message: str) -> None:
    print(f"[install {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.install", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size-mb", type=int, default=1000, help="model size in MiB (bf16)")
    p.add_argument("--quick", action="store_true", help=f"a {QUICK_MB} MiB model")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each variant (the best is the figure)")
    p.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1),
                   help="threads of the reference copy and of the readers")
    p.add_argument("--device", default="cpu", help="where the module's parameters live (cpu, cuda, cuda:1, ...)")
    p.add_argument("--torch-threads", type=int, help="torch's intra-op threads (default: torch's own); 1 makes each "
                                                     "copy_ one thread, as a GPU engine's copy from host memory is")
    p.add_argument("--json", type=Path, help="where to write the result (default benchmarks/results/install-*.json)")
    p.add_argument("--keep", action="store_true", help="keep the working folder")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mb = QUICK_MB
    if args.repeat < 1 or args.threads < 1 or (args.torch_threads is not None and args.torch_threads < 1):
        p.error("--repeat, --threads and --torch-threads must be at least 1")
    return args


# -- the checkpoint, prepared by the receiver ---------------------------------------------------------------


def prepare_store(root: Path, size_bytes: int):
    """Write the checkpoint, publish it as r0 and refit a receiver store to it; returns the store and the tensors."""
    from benchmarks._model import shape_for
    from flows.publish import run_publish
    from flows.refit import run_refit
    from flows.synthetic import random_model, write_checkpoint
    from storage.settings import InstallerSettings, PublishParams, RefitParams
    from storage.store.local_store import LocalStore

    shape = shape_for(size_bytes)
    tensors = random_model(shape, seed=1)
    write_checkpoint(root / "launch", tensors, shards=shape.shards)
    run_publish(PublishParams(catalog=str(root / "catalog"), model=MODEL, checkpoint=root / "launch", kind="initial",
                              state_dir=root / "publisher", emit_event=False, keep_copy=False))
    result = run_refit(RefitParams(catalog=str(root / "catalog"), model=MODEL, seed_checkpoint=str(root / "launch"),
                                   cache_dir=root / "cache", installer=InstallerSettings(kind="none"),
                                   lock_timeout_s=60))
    store = LocalStore(root / "cache", MODEL)
    current = store.current()
    if current is None or current.version != "r0" or store.state().status != "READY":
        raise RuntimeError(f"the refit did not prepare r0: {result.status} {result.error}")
    return shape, store, tensors


def warm(folder: Path) -> float:
    """Read every file of ``folder`` once, so the timed runs find it in the page cache; returns seconds."""
    started = time.perf_counter()
    for path in sorted(folder.iterdir()):
        with open(path, "rb", buffering=0) as fh:
            while fh.read(16 * 2**20):
                pass
    return time.perf_counter() - started


# -- the module ----------------------------------------------------------------------------------------------


def module_for(locations, device):
    """A torch module whose parameters have the checkpoint's names, shapes and dtype (bf16), zeroed, on ``device``."""
    import torch

    root = torch.nn.Module()
    for t in locations:
        *path, leaf = t.name.split(".")
        owner = root
        for part in path:
            child = dict(owner.named_children()).get(part)
            if child is None:
                child = torch.nn.Module()
                owner.add_module(part, child)
            owner = child
        owner.register_parameter(leaf, torch.nn.Parameter(
            torch.zeros(t.shape, dtype=torch.bfloat16, device=device), requires_grad=False))
    return root


def zero(model) -> None:
    for param in model.parameters():
        param.data.zero_()
    sync(model)


def sync(model) -> None:
    import torch

    if next(model.parameters()).device.type == "cuda":
        torch.cuda.synchronize()


def mismatches(model, tensors: dict[str, np.ndarray]) -> list[str]:
    """Names of the parameters whose bits differ from the checkpoint's."""
    import torch

    params = dict(model.named_parameters())
    return [name for name, bits in tensors.items()
            if not np.array_equal(params[name].detach().view(torch.int16).cpu().numpy(), bits.view(np.int16))]


# -- the reference: a plain parallel copy from the page cache ----------------------------------------------


def reference_copy(folder: Path, locations, params: dict, threads: int) -> None:
    """Map each shard, view every tensor with ``torch.frombuffer``, ``param.copy_(view)`` on ``threads`` threads."""
    import torch

    maps = {}
    for file in sorted({t.file for t in locations}):
        with open(folder / file, "rb") as fh:
            maps[file] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)

    def copy(t) -> None:
        view = torch.frombuffer(maps[t.file], dtype=torch.bfloat16, count=t.nbytes // 2, offset=t.offset)
        params[t.name].data.copy_(view.view(t.shape))

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(copy, sorted(locations, key=lambda t: -t.nbytes)))


# -- the loader's stand-in for SGLang, and the readers it is measured with ---------------------------------


class PlainModelLoader:
    """What ``load_prepared_checkpoint`` needs from SGLang's ``DefaultModelLoader``, for a plain torch module.

    ``load`` does what ``load_weights_and_postprocess`` does for a model
    without quantization: the model's ``load_weights`` with SGLang's
    ``default_weight_loader``, a shape check and ``param.data.copy_(tensor)``.
    """

    def __init__(self, read):
        self.read = read

    def weights(self, model, folder: Path):
        return self.read(folder)

    def load(self, model, weights) -> None:
        params = dict(model.named_parameters())
        for name, tensor in weights:
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not fit {tuple(param.shape)}")
            param.data.copy_(tensor)


def shard_files(folder: Path) -> list[Path]:
    """The shards SGLang reads in a prepared folder: the index's files (``filter_duplicate_safetensors_files``),
    sorted."""
    from storage.format.checkpoint import CheckpointIndex

    return [folder / name for name in sorted(CheckpointIndex.open(folder).headers)]


def sequential_weights(folder: Path):
    """SGLang's ``safetensors_weights_iterator``: ``safe_open`` per shard, one tensor after another."""
    from safetensors import safe_open

    for path in shard_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def sglang_threaded_weights(folder: Path, max_workers: int):
    """SGLang 0.5.23's ``buffered_multi_thread_safetensors_weights_iterator``: whole shards on threads, a window of
    ``max_workers + 1`` shards, each shard's tensors yielded in name order."""
    from safetensors import safe_open

    def load_file(path: Path) -> dict:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            return {name: fh.get_tensor(name) for name in fh.keys()}

    files = iter(shard_files(folder))
    with concurrent.futures.ThreadPoolExecutor(max_workers) as pool:
        pending = collections.deque(pool.submit(load_file, f) for f in itertools.islice(files, max_workers + 1))
        while pending:
            state = pending.popleft().result()
            following = next(files, None)
            if following is not None:
                pending.append(pool.submit(load_file, following))
            for name in sorted(state):
                yield name, state[name]
            del state


def readers(threads: int) -> dict:
    from tasks.installers.weights_reader import parallel_weights

    return {"sequential": sequential_weights,
            "sglang_threads": lambda folder: sglang_threaded_weights(folder, threads),
            "parallel": lambda folder: parallel_weights(folder, threads)}


def install_once(model, store, read) -> tuple[float, object]:
    """One install as the engine runs it: a fresh request, then the hook; returns its seconds and the rank's report."""
    from tasks.installers.sglang_loader import OK, LoaderSettings, LoadRequest, load_prepared_checkpoint, \
        read_reports, write_request
    from storage.store.local_store import now_ms

    current = store.current()
    request = LoadRequest(request_id=uuid.uuid4().hex, model=store.model, version=current.version,
                          digest=current.target_digest, format_digest=current.format_digest, path=current.path,
                          files=current.files, installer="benchmark", created_at_unix_ms=now_ms(),
                          deadline_unix_ms=now_ms() + 600_000)
    write_request(store, request)
    settings = LoaderSettings(cache_dir=store.root.parent, model=store.model, loader_lock_timeout_s=60)
    started = time.perf_counter()
    load_prepared_checkpoint(model, [], settings=settings, loader_factory=lambda: PlainModelLoader(read))
    sync(model)
    seconds = time.perf_counter() - started
    reports = read_reports(store, request.request_id)
    if len(reports) != 1 or reports[0].status != OK:
        raise RuntimeError(f"the loader did not report ok: {reports}")
    return seconds, reports[0]


# -- the run ---------------------------------------------------------------------------------------------------


def rate(seconds: list[float], nbytes: int) -> dict:
    best = min(seconds)
    return {"seconds": round(best, 4), "gb_s": round(nbytes / best / 1e9, 3), "runs": [round(s, 4) for s in seconds]}


def run(args: argparse.Namespace, root: Path) -> dict:
    import torch
    from storage.format.checkpoint import CheckpointIndex

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    result = {"schema": SCHEMA, "machine": machine(), "config": {k: str(v) for k, v in vars(args).items()},
              "torch": {"version": torch.__version__, "intra_op_threads": torch.get_num_threads()}}
    started = time.perf_counter()
    shape, store, tensors = prepare_store(root, args.size_mb * 2**20)
    folder = store.absolute(store.current().path)
    locations = sorted(CheckpointIndex.open(folder).tensors.values(), key=lambda t: (t.file, t.offset))
    nbytes = sum(t.nbytes for t in locations)
    result["model"] = {"shape": dataclasses.asdict(shape), "bytes": nbytes, "tensors": len(locations), "shards": len({t.file for t in locations}),
                       "largest_tensor_bytes": max(t.nbytes for t in locations), "dtype": "bfloat16",
                       "device": args.device, "folder": store.relative(folder), "store_status": store.state().status,
                       "version": store.current().version, "prepare_s": round(time.perf_counter() - started, 2)}
    result["model"]["warm_read_s"] = round(warm(folder), 3)
    log(f"{nbytes / 1e6:.0f} MB in {result['model']['tensors']} tensors, {result['model']['shards']} shards, "
        f"READY in {store.root}; module on {args.device}, {args.threads} threads, best of {args.repeat}")

    model = module_for(locations, args.device)
    params = dict(model.named_parameters())
    assert sorted(params) == sorted(tensors), "the module's parameters are not the checkpoint's tensors"
    variants = readers(args.threads)
    times: dict[str, list[float]] = {"reference": [], **{name: [] for name in variants}}
    report_s: dict[str, list[float]] = {name: [] for name in variants}
    wrong: dict[str, list[str]] = {}
    for attempt in range(args.repeat):  # the variants interleaved, so drift in the machine hits all alike
        zero(model)
        t0 = time.perf_counter()
        reference_copy(folder, locations, params, args.threads)
        sync(model)
        times["reference"].append(time.perf_counter() - t0)
        if attempt == args.repeat - 1:
            wrong["reference"] = mismatches(model, tensors)
        for name, read in variants.items():
            zero(model)
            seconds, report = install_once(model, store, read)
            times[name].append(seconds)
            report_s[name].append(report.seconds)
            if report.tensors != len(locations) or report.bytes != nbytes:
                raise RuntimeError(f"{name}: the report counts {report.tensors} tensors, {report.bytes} bytes")
            if attempt == args.repeat - 1:
                wrong[name] = mismatches(model, tensors)
        log(f"round {attempt + 1}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()))
    bad = {name: names[:5] for name, names in wrong.items() if names}
    if bad:
        raise RuntimeError(f"parameters differ from the checkpoint after: {bad}")

    reference = rate(times["reference"], nbytes) | {"threads": args.threads,
                                                    "what": "mmap each shard, torch.frombuffer views, "
                                                            "param.copy_(view) on a thread pool"}
    result["reference"] = reference
    result["loader"] = {}
    for name in variants:
        row = rate(times[name], nbytes)
        row["over_reference"] = round(row["seconds"] / reference["seconds"], 3)
        row["report_seconds"] = min(report_s[name])
        row["reader"] = READERS[name]
        result["loader"][name] = row
    measured = result["loader"]["parallel"]["over_reference"]
    result["goal"] = {"target": "install pause (the loader with its own reader) <= 1.3 x a plain parallel copy",
                      "measured": measured, "bound": GOAL_OVER_REFERENCE, "met": measured <= GOAL_OVER_REFERENCE}
    result["verified"] = "every variant's parameters equal the checkpoint bit for bit"
    return result


def table(result: dict) -> str:
    model, ref, goal = result["model"], result["reference"], result["goal"]
    labels = {"sequential": "loader, sequential reader (SGLang safetensors_weights_iterator)",
              "sglang_threads": "loader, shard-per-thread reader (SGLang 0.5.23 default)",
              "parallel": "loader, parallel_weights (the loader's own reader)"}
    width = max(len(v) for v in labels.values())
    lines = [f"install into a torch module on {model['device']}: {model['bytes'] / 1e6:,.0f} MB bf16, "
             f"{model['tensors']} tensors in {model['shards']} shards, {ref['threads']} threads (torch intra-op "
             f"{result['torch']['intra_op_threads']}), best of {len(ref['runs'])}, checkpoint in the page cache",
             f"  {'':{width}}  seconds     GB/s  x reference",
             f"  {'reference, plain parallel copy (mmap, copy_)':{width}}  {ref['seconds']:7.3f}  {ref['gb_s']:7.2f}"
             f"  {1:11.2f}"]
    for name, row in result["loader"].items():
        lines.append(f"  {labels.get(name, name):{width}}  {row['seconds']:7.3f}  {row['gb_s']:7.2f}"
                     f"  {row['over_reference']:11.2f}")
    lines.append(f"  {goal['target']}: {goal['measured']} x (bound {goal['bound']}) "
                 f"{'met' if goal['met'] else 'not met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return bench_main("install", argv, parse_args, run, table, log)


if __name__ == "__main__":
    sys.exit(main())
