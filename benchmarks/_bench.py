"""The command line the fleet-lab benchmarks share (``benchmarks.fleet``, ``benchmarks.warm``).

``bench_main`` runs one in a scratch folder (removed unless ``--keep``),
writes its JSON under ``benchmarks/results/`` (or ``--json``) and prints its
table.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from testbed.processes import load_average

ROOT = Path(__file__).resolve().parents[1]


def bench_main(name: str, argv: list[str] | None, parse_args, run, table, log) -> int:
    """The command line of a fleet-lab benchmark: a scratch folder, ``run``, its JSON under benchmarks/results/,
    then ``table`` printed."""
    import shlex
    import shutil
    import tempfile
    from datetime import datetime, timezone

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.json or ROOT / "benchmarks" / "results" / f"{name}-{stamp}.json"
    root = Path(tempfile.mkdtemp(prefix=f"canonical-refit-{name}-"))
    log(f"working in {root}; load average {load_average()}")
    started = time.perf_counter()
    try:
        result = run(args, root)
    finally:
        if args.keep:
            log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    result["command"] = f"python -m benchmarks.{name} " + shlex.join(argv)
    result["started_at"] = stamp
    result["seconds"] = round(time.perf_counter() - started, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(table(result))
    print(f"\nJSON: {out}")
    return 0
