"""Catalog length (``python -m benchmarks.catalog``): publishing, refitting and skipping at 10, 1,000 and 5,000
records, on file:// and on moto's S3 server.

For each backend and catalog length N the benchmark builds a catalog of N
records: the launch revision published for real, N - 3 full-checkpoint records
and their sequence claims written as publications leave them (their payloads
are never read), then one full revision published for real. It then measures,
through ``flows.api`` in this process (a tiny model: the figures are the
catalog's cost, not the bytes'):

* **publish one revision**: a delta on top of the newest (the ``plan
  revision`` stage is where the catalog is read; best of ``--repeat``);
* **fresh node, resolve catalog**: a refit of an empty node to ``latest``, the
  ``resolve catalog`` stage (best of ``--repeat`` fresh nodes);
* **refit at latest**: a refit of a node already at ``latest`` (median);
* **--only-if-newer skip**: the same with ``only_if_newer`` (median).

Each operation prints its seconds and its requests: the object-store calls on
objects under the catalog prefix (``ObjectStore.call``: a read, a stat, an
existence probe, a listing, a write) and, on S3, the HTTP requests the server
received for them (counted by ``testbed.s3proxy`` in front of moto). The goal
(issue: flat in catalog length): each operation at the largest N within 1.5 ×
its time at the smallest, or 0.3 s more; a fresh node's resolve within 3 ×
(or 0.3 s more). On S3 the padding is written straight to moto (not counted).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote

from benchmarks._bench import bench_main
from testbed.processes import machine

SCHEMA = "canonical-refit.benchmark.catalog.v1"
MODEL = "bench/catalog"
BUCKET = "bench"
GOALS = {"publish one revision": 1.5, "refit at latest": 1.5, "only-if-newer skip": 1.5,
         "fresh node, resolve catalog": 3.0}
SLACK_S = 0.3


def log(message: str) -> None:
    print(f"[catalog {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.catalog", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", default="10,1000,5000", help="comma-separated catalog lengths (records)")
    p.add_argument("--backends", default="file,s3", help="comma-separated: file (file://), s3 (moto's server)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each operation")
    p.add_argument("--json", type=Path, help="where to write the result (default benchmarks/results/catalog-*.json)")
    p.add_argument("--keep", action="store_true", help="keep the working folder")
    args = p.parse_args(argv)
    try:
        args.size_list = sorted({int(n) for n in args.sizes.split(",") if n.strip()})
    except ValueError:
        p.error(f"--sizes: not a list of integers: {args.sizes!r}")
    if not args.size_list or args.size_list[0] < 4:
        p.error("--sizes: every catalog holds at least 4 records")
    args.backend_list = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not set(args.backend_list) <= {"file", "s3"}:
        p.error(f"--backends: file and/or s3, not {args.backends!r}")
    return args


class Meter:
    """Object-store calls on objects under one prefix (wraps ``ObjectStore.call`` while installed)."""

    def __init__(self):
        from storage.objects.store import ObjectStore

        self.calls: list[str] = []
        self._original = ObjectStore.call
        meter = self

        def counting(store, what, url, fn, **kw):
            meter.calls.append(url)
            return meter._original(store, what, url, fn, **kw)

        ObjectStore.call = counting

    def close(self) -> None:
        from storage.objects.store import ObjectStore

        ObjectStore.call = self._original

    def count(self, prefix: str, since: int) -> int:
        return sum(1 for url in self.calls[since:] if url == prefix or url.startswith(prefix + "/"))


class Backend:
    """Where the catalogs live: file:// under the scratch folder, or s3:// on moto behind a counting proxy."""

    def __init__(self, kind: str, root: Path):
        self.kind, self.root = kind, root
        self.server = self.proxy = None
        self.storage = None
        if kind == "s3":
            from storage.settings import ObjectStoreSettings
            from testbed.s3 import MotoServer
            from testbed.s3proxy import FaultProxy

            for key, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                               "AWS_DEFAULT_REGION": "us-east-1"}.items():
                os.environ.setdefault(key, value)
            self.server = MotoServer(root / "moto.log", BUCKET).start()
            self.proxy = FaultProxy(self.server.url, lifetime_s=3600.0).start()
            self.storage = ObjectStoreSettings(endpoint_url=self.proxy.url, region="us-east-1",
                                               addressing_style="path")
            self.direct = ObjectStoreSettings(endpoint_url=self.server.url, region="us-east-1",
                                              addressing_style="path", concurrency=16)

    def base(self, n: int) -> str:
        return f"s3://{BUCKET}/n{n}" if self.kind == "s3" else f"file://{self.root}/{self.kind}-n{n}"

    def http(self, prefix: str) -> int | None:
        """HTTP requests the server got for objects under ``prefix`` (s3 only)."""
        if self.proxy is None:
            return None
        key = prefix.split("://", 1)[1].split("/", 1)[1]
        return sum(1 for r in list(self.proxy.log) if key in unquote(f"{r.path}?{r.query}"))

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        if self.server is not None:
            self.server.stop()


def pad(backend: Backend, catalog_url: str, first: int, last: int) -> None:
    """Records ``r{first}`` .. ``r{last}`` (full checkpoints nothing reads) with their claims, the last through
    ``Catalog.write`` (the head hint then names it), as a run of publications leaves them."""
    from storage.jsonio.canonical import canonical_json
    from storage.catalog.records import Catalog, Revision
    from storage.objects.store import ObjectStore
    from storage.urls import join_url

    objects = ObjectStore(backend.direct) if backend.kind == "s3" else ObjectStore()
    catalog = Catalog(objects, catalog_url, MODEL)
    r0 = catalog.read("r0").to_json()

    def put(n: int) -> None:
        record = dict(r0, version=f"r{n}", sequence=n, payload_format="full_hf_checkpoint",
                      target_digest="sha256:" + f"{n:064x}", created_at_unix_ms=n,
                      uri=join_url(catalog_url.rsplit("/", 1)[0], f"nowhere/r{n}/model.safetensors.index.json"))
        objects.put_replace(catalog.claim_url(n), canonical_json(
            {"model": MODEL, "sequence": n, "version": f"r{n}", "publication": "padding"}))
        if n == last:
            catalog.write(Revision.model_validate(record))
        else:
            objects.put_replace(catalog.record_url(f"r{n}"), canonical_json(record))

    with ThreadPoolExecutor(16 if backend.kind == "s3" else 4) as pool:
        list(pool.map(put, range(first, last)))
    put(last)


def stage_seconds(stages: list[dict], name: str) -> float:
    return next(float(s["seconds"]) for s in stages if s["name"] == name)


def one_catalog(backend: Backend, meter: Meter, n: int, repeat: int) -> dict:
    """Every operation on a catalog of ``n`` records (grown by ``repeat`` publications as it goes)."""
    from flows import api
    from flows.synthetic import ModelShape, random_model, train_step, write_checkpoint

    folder = backend.root / f"{backend.kind}-{n}"
    catalog = f"{backend.base(n)}/catalog"
    tensors = random_model(ModelShape(vocab=512, hidden=64, intermediate=160, layers=2, shards=2), seed=1)
    write_checkpoint(folder / "launch", tensors, shards=2)
    common = dict(catalog=catalog, model=MODEL, state_dir=folder / "publisher", emit_event=False,
                  storage=backend.storage)
    api.publish(tensors, kind="initial", **common)
    t0 = time.perf_counter()
    pad(backend, catalog, 1, n - 3)
    built_s = time.perf_counter() - t0
    tensors = train_step(tensors, seed=2)
    api.publish(tensors, kind="full", **common)

    def measured(fn):
        since, http = len(meter.calls), backend.http(catalog)
        t = time.perf_counter()
        result = fn()
        wall = time.perf_counter() - t
        row = {"wall_s": round(wall, 4), "requests": meter.count(catalog, since)}
        if http is not None:
            row["http_requests"] = backend.http(catalog) - http
        return result, row

    rows: dict[str, list[dict]] = {op: [] for op in GOALS}
    for i in range(repeat):
        tensors = train_step(tensors, seed=3 + i)
        result, row = measured(lambda: api.publish(tensors, kind="delta", **common))
        row["seconds"] = round(result.seconds, 4)
        row["plan_s"] = round(stage_seconds(result.stages, "plan revision"), 4)
        rows["publish one revision"].append(row)
    node = dict(catalog=catalog, model=MODEL, seed_checkpoint=folder / "launch", installer={"kind": "none"},
                storage=backend.storage, apply_workers=2)
    for i in range(repeat):
        result, row = measured(lambda: api.refit(cache_dir=folder / f"fresh-{i}", **node))
        assert result.status == "READY", result.error
        row["seconds"] = round(stage_seconds(result.stages, "resolve catalog"), 4)
        rows["fresh node, resolve catalog"].append(row)
    for i in range(repeat):
        result, row = measured(lambda: api.refit(cache_dir=folder / "fresh-0", **node))
        assert result.status == "READY", result.error
        row["seconds"] = row["wall_s"]
        rows["refit at latest"].append(row)
        result, row = measured(lambda: api.refit(cache_dir=folder / "fresh-0", only_if_newer=True, **node))
        assert result.status == "SKIPPED", result.error
        row["seconds"] = row["wall_s"]
        rows["only-if-newer skip"].append(row)
    out = {"records": n, "padding_written_s": round(built_s, 2), "runs": rows}
    for op, runs in rows.items():
        pick = min if op in ("publish one revision", "fresh node, resolve catalog") else statistics.median
        out[op] = {"seconds": round(pick(r["seconds"] for r in runs), 4),
                   "requests": max(r["requests"] for r in runs)}
        if "http_requests" in runs[0]:
            out[op]["http_requests"] = max(r["http_requests"] for r in runs)
        if op == "publish one revision":
            out[op]["plan_s"] = round(min(r["plan_s"] for r in runs), 4)
    log(f"{backend.kind} {n} records: " + "; ".join(f"{op} {out[op]['seconds']} s, {out[op]['requests']} req"
                                                     for op in GOALS))
    return out


def goals(rows: list[dict]) -> dict:
    """Largest over smallest catalog, per operation: the ratio, the difference and whether the goal is met."""
    small, large = rows[0], rows[-1]
    out = {}
    for op, limit in GOALS.items():
        a, b = small[op]["seconds"], large[op]["seconds"]
        ratio = round(b / a, 3) if a > 0 else None
        out[op] = {"ratio": ratio, "extra_s": round(b - a, 4), "goal": f"<= {limit} x or + {SLACK_S} s",
                   "requests": [small[op]["requests"], large[op]["requests"]],
                   "met": (ratio is not None and ratio <= limit) or b - a <= SLACK_S}
    return out


def run(args: argparse.Namespace, root: Path) -> dict:
    result = {"schema": SCHEMA, "machine": machine(), "sizes": args.size_list, "backends": {}}
    meter = Meter()
    try:
        for kind in args.backend_list:
            backend = Backend(kind, root)
            try:
                rows = [one_catalog(backend, meter, n, args.repeat) for n in args.size_list]
            finally:
                backend.close()
            result["backends"][kind] = {"catalogs": rows, "goals": goals(rows)}
    finally:
        meter.close()
    result["all_met"] = all(g["met"] for b in result["backends"].values() for g in b["goals"].values())
    return result


def table(result: dict) -> str:
    sizes = result["sizes"]
    lines = []
    for kind, data in result["backends"].items():
        head = f"{'operation (' + kind + ')':<30}" + "".join(f"{n:>28,}" for n in sizes) + "   ratio   goal"
        lines += ["", head, "-" * len(head)]
        for op in GOALS:
            cells = []
            for row in data["catalogs"]:
                req = row[op]["requests"]
                http = row[op].get("http_requests")
                cells.append(f"{row[op]['seconds']:.3f} s {req:>3} req" + (f" {http:>3} http" if http is not None
                                                                           else " " * 9))
            g = data["goals"][op]
            lines.append(f"{op:<30}" + "".join(f"{c:>28}" for c in cells)
                         + f"   {g['ratio'] if g['ratio'] is not None else '-':>5}   {'met' if g['met'] else 'NOT met'}")
    lines.append("")
    lines.append(f"goal ({sizes[-1]:,} vs {sizes[0]:,} records): <= 1.5 x or + {SLACK_S} s; a fresh node's resolve "
                 f"<= 3 x or + {SLACK_S} s: {'all met' if result['all_met'] else 'NOT all met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return bench_main("catalog", argv, parse_args, run, table, log)


if __name__ == "__main__":
    sys.exit(main())
