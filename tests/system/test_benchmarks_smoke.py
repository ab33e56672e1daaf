"""The refit benchmark runs end to end at a tiny size and writes its JSON and plot (no timing assertions).

It runs as a command (``python -m benchmarks.refit`` from the repository
root), the way it is documented: the tests import no benchmark module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SECTIONS = ("machine", "config", "model", "revisions", "kernels", "decode", "sweep", "decode_dense", "apply_threads",
            "apply_disk",
            "refits", "catch_up", "memory", "fetch", "baseline", "fetch_only", "baseline_throttled", "overlap",
            "prefect", "targets", "load", "disk", "errors", "publish_memory")


def run_benchmark(module: str, *args: str, timeout_s: float = 800) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS...`` from the repository root (which is on its PYTHONPATH); it must exit 0."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=os.environ | {"PYTHONPATH": path},
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{module} exited with {done.returncode}:\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"
    return done


def test_tiny_benchmark_writes_every_section(tmp_path):
    out = tmp_path / "result.json"
    done = run_benchmark("benchmarks.refit", "--size-mb", "4", "--catch-up", "2", "--threads", "1,2",
                         "--apply-workers", "2", "--prefect", "none", "--bandwidth-mb-s", "400", "--kernel-mb", "2",
                         "--repeat", "1", "--workdir", str(tmp_path), "--json", str(out))
    result = json.loads(out.read_text())
    assert set(SECTIONS) <= set(result)
    assert result["schema"] == "canonical-refit.benchmark.refit.v1"
    assert result["errors"] == []
    assert (tmp_path / "result.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "targets (measured / bound)" in done.stdout

    # every refit the benchmark timed installed the exact revision it asked for
    refits = result["refits"]
    assert [run["version"] for run in refits["sequential"]["runs"]] == ["r2", "r3"]
    assert refits["catchup"]["runs"][0]["lineage"] == ["r1", "r2", "r3"]
    for name in ("cold", "single", "catchup", "throttled"):
        for run in refits[name]["runs"]:
            assert run["status"] == "READY" and run["digest"].startswith("sha256:")
            assert {s["stage"] for s in run["stages"]} >= {"fetch buckets", "apply deltas", "verify digest"}

    # the measurements are of the published data: sizes agree with the catalog
    r2 = next(r for r in result["revisions"] if r["version"] == "r2")
    assert result["decode"]["revisions"]["r2"]["decoded_bytes"] == r2["decoded_bytes"]
    # the RL sweep: every share published in each setting, the changed share rising with the requested one
    sweep = result["sweep"]
    assert [row["share"] for row in sweep] == ["0.5%", "1%", "2%", "5%", "dense"]
    shares = [row["changed_element_share"] for row in sweep]
    assert shares == sorted(shares) and 0 < shares[0] < 0.02 and shares[-1] > 0.2
    for row in sweep:
        assert set(row["publish"]) == {"auto", "xor", "xor_gaps"}
        assert row["publish"]["auto"]["encoding"] in ("xor", "xor_sparse", "overwrite")
        assert 0 < row["publish"]["xor_gaps"]["fraction_of_full"] < 1
        assert all(a["over_reference"] > 0 for a in row["apply"].values())
    dense_bytes = sweep[-1]["xor_reference"]["bytes"]
    assert [row["threads"] for row in result["apply_threads"]] == [1, 2]
    assert all(row["applied_bytes"] == dense_bytes for row in result["apply_threads"])
    assert result["baseline"]["applied_bytes"] == r2["decoded_bytes"]
    # the rate-limited store really served the bytes of the throttled refit
    assert refits["throttled"]["throttled_bytes"] >= r2["encoded_bytes"]
    # folding two deltas dirties the changed tensors once; two one-delta refits dirty them twice
    catch_up = result["catch_up"]
    assert catch_up["k"] == 2
    assert catch_up["folded"]["checkpoint_write_bytes"] < catch_up["sequential"]["checkpoint_write_bytes"]
    assert result["prefect"] == {"ephemeral": None, "server": None}
    names = [t["target"] for t in result["targets"]]
    for prefix in ("bytes at 2 % changed", "publish at 2 % changed", "publish a 2 % step from memory",
                   "apply at 2 % changed", "dense step: apply",
                   "overlap", "catch-up"):
        assert any(n.startswith(prefix) for n in names), prefix
    assert all(t["met"] in (True, False, None) for t in result["targets"])
    assert result["overlap"]["runs"]["refit runbook without Prefect"]["data_plane_s"] > 0
    assert result["disk"]["peak_bytes"] > 0
    # the temporary model and catalog are gone; only the result files stay
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json", "result.png"]


def test_publish_benchmark_publishes_from_one_process_and_from_ranks(tmp_path):
    """``benchmarks.publish`` at a tiny size: the one-process publisher beside its XOR reference, and the sharded
    example with one and two rank processes, every step a revision in its catalog."""
    out = tmp_path / "publish.json"
    done = run_benchmark("benchmarks.publish", "--size-mb", "4", "--steps", "2", "--ranks", "1,2", "--train-s", "0.2",
                         "--json", str(out))
    result = json.loads(out.read_text())
    assert result["schema"] == "canonical-refit.benchmark.publish.v1"
    one = result["one_process"]
    assert [s["version"] for s in one["steps"]] == ["r1", "r2"]
    for step in one["steps"]:
        assert 0.005 < step["changed_element_share"] < 0.05 and step["encoded_bytes"] > 0
        assert step["xor"]["bytes"] == step["model_bytes"]
        assert set(step["stages"]) == {"plan revision", "encode payload", "upload payload", "write record"}
    assert one["goal"]["met"] == (one["goal"]["measured"] >= 0.5)
    assert [row["ranks"] for row in result["sharded"]] == [1, 2]
    for row in result["sharded"]:
        assert row["versions"] == ["r0", "r1", "r2"]  # every step one revision, from every rank together
        assert len(row["best"]["per_rank_gb_s"]) == row["ranks"]
        assert row["best"]["model_bytes"] == one["best"]["model_bytes"]  # the ranks hold the whole model
    assert "publish from memory >= 0.5 x in-memory XOR" in done.stdout
    lap = result["overlap"]  # the training loop against capped S3, waiting for each publication and not
    for label in ("waiting", "not waiting"):
        rows = lap[label]["rows"]
        assert len(rows) == 3
        assert all(isinstance(r[key], float) for r in rows for key in ("step_s", "blocked_s", "publication_s"))
    assert "publish(wait=False):" in done.stdout
