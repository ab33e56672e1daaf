"""A catalog of thousands of revisions costs what a catalog of ten does, and no object in it can jam a refit.

The costs are counted, not timed: every object-store operation (``ObjectStore.call``: a read, a stat, an
existence probe, a listing, a write) on an object under the catalog prefix, while a real publication and real
refits run (flows.api, the CLI). Catalogs of 10, 1,000 and 5,000 records are built cheaply: the launch
revision and the newest revisions are published for real, the ones between are full-checkpoint records and
their sequence claims written as a publisher leaves them (their payloads are never needed: nothing reads them).
docs/format.md, 4.9 says how ``latest`` is found and what the head hint is.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from flows import api
from tests.support.lab import ROOT_DIR, Lab, tiny_shape
from storage.jsonio.canonical import canonical_json
from storage.catalog.publisher import next_sequence
from storage.catalog.records import Catalog, Revision
from storage.errors import CatalogError
from storage.objects.store import ObjectStore

SIZES = (10, 1000, 5000)


class Meter:
    """Counts object-store operations by kind on objects under a prefix (wraps ``ObjectStore.call``)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, str]] = []
        original = ObjectStore.call

        def counting(store, what, url, fn, **kw):
            self.calls.append((what, url))
            return original(store, what, url, fn, **kw)

        monkeypatch.setattr(ObjectStore, "call", counting)

    def reset(self) -> None:
        self.calls.clear()

    def under(self, prefix: str) -> Counter:
        prefix = prefix.rstrip("/")
        return Counter(what for what, url in self.calls if url == prefix or url.startswith(prefix + "/"))


@pytest.fixture
def meter(monkeypatch) -> Meter:
    return Meter(monkeypatch)


def pad(lab: Lab, first: int, last: int) -> None:
    """Records ``r{first}`` .. ``r{last}`` with their claims, as publications of full checkpoints leave them
    (payload URLs that nothing reads), the last one written through ``Catalog.write`` (so the head hint names it)."""
    r0 = json.loads((lab.catalog_dir / "r0.json").read_bytes())
    claims = lab.catalog_dir / "sequences"
    claims.mkdir(exist_ok=True)
    catalog = Catalog(ObjectStore(), lab.catalog, lab.model)
    for n in range(first, last + 1):
        record = dict(r0, version=f"r{n}", sequence=n, payload_format="full_hf_checkpoint",
                      target_digest="sha256:" + f"{n:064x}", created_at_unix_ms=n,
                      uri=f"file://{lab.root}/nowhere/r{n}/model.safetensors.index.json")
        (claims / f"{n:012d}.json").write_bytes(canonical_json(
            {"model": lab.model, "sequence": n, "version": f"r{n}", "publication": "padding"}))
        if n == last:
            catalog.write(Revision.model_validate(record))
        else:
            (lab.catalog_dir / f"r{n}.json").write_bytes(canonical_json(record))


def refit(lab: Lab, cache: Path | None = None, **kw):
    return api.refit(catalog=lab.catalog, model=lab.model, cache_dir=cache or lab.cache,
                     seed_checkpoint=lab.launch, installer={"kind": "none"}, check=False, apply_workers=2, **kw)


def costs(lab: Lab, meter: Meter, records: int) -> dict[str, Counter]:
    """Catalog operations of: publishing a delta, a fresh node's refit, a refit at latest, the --only-if-newer
    skip, on a catalog of ``records`` records (r0 .. r{records-1}), the newest two published for real."""
    lab.publish("initial")
    pad(lab, 1, records - 3)
    lab.publish("full")
    out = {}
    meter.reset()
    published = lab.publish("delta")
    out["publish"] = meter.under(lab.catalog)
    assert published.version == f"r{records - 1}"
    meter.reset()
    result = refit(lab)
    out["fresh node"] = meter.under(lab.catalog)
    assert result.status == "READY" and result.version == f"r{records - 1}", result.error
    assert result.lineage == [f"r{records - 2}", f"r{records - 1}"]
    lab.assert_checkpoint(Path(result.checkpoint_path), result.version)
    meter.reset()
    result = refit(lab)
    out["refit at latest"] = meter.under(lab.catalog)
    assert result.status == "READY" and result.version == f"r{records - 1}", result.error
    meter.reset()
    result = refit(lab, only_if_newer=True)
    out["only-if-newer skip"] = meter.under(lab.catalog)
    assert result.status == "SKIPPED" and "not newer" in result.notes[-1]
    return out


def test_publishing_refitting_and_skipping_cost_the_same_at_5000_records_as_at_10(tmp_path, meter):
    found = {n: costs(Lab(tmp_path / f"n{n}", shape=tiny_shape()), meter, n) for n in SIZES}
    for operation in found[10]:
        small, total = found[10][operation], sum(found[10][operation].values())
        assert total > 0, operation  # the meter sees the operation's requests at all
        for n in SIZES[1:]:
            assert found[n][operation] == small, (operation, n, found[n][operation], small)
    assert found[5000]["refit at latest"]["list"] == 0 and found[5000]["fresh node"]["list"] == 0


def catalog_of(tmp_path: Path, records: int) -> Lab:
    lab = Lab(tmp_path, shape=tiny_shape())
    lab.publish("initial")
    pad(lab, 1, records - 1)
    return lab


def hint_path(lab: Lab) -> Path:
    return lab.catalog_dir / "hints" / "head.json"


@pytest.mark.parametrize("hint", ["older", "nonexistent", "corrupt", "deep", "another model", "missing"])
def test_a_wrong_head_hint_is_checked_found_wrong_and_corrected_by_the_publisher(tmp_path, meter, hint):
    lab = catalog_of(tmp_path, 1000)
    good = hint_path(lab).read_bytes()
    wrong = {
        "older": canonical_json({"model": lab.model, "sequence": 17, "version": "r17"}),
        "nonexistent": canonical_json({"model": lab.model, "sequence": 123456789, "version": "r123456789"}),
        "corrupt": b"\xff\xfe{\x00",
        "deep": b'{"junk":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "another model": canonical_json({"model": "org/other", "sequence": 3, "version": "r3"}),
    }
    if hint == "missing":
        hint_path(lab).unlink()
    else:
        hint_path(lab).write_bytes(wrong[hint])
    meter.reset()
    assert Catalog(ObjectStore(), lab.catalog, lab.model).latest().version == "r999"
    probes = meter.under(lab.catalog)
    assert probes["list"] == 0 and sum(probes.values()) <= 2 * 27 + 4  # O(log N): galloping, then bisecting
    assert next_sequence(Catalog(ObjectStore(), lab.catalog, lab.model))[0] == 1000
    assert hint_path(lab).read_bytes() == good  # the publisher put it right
    meter.reset()
    assert Catalog(ObjectStore(), lab.catalog, lab.model).latest().version == "r999"
    assert sum(meter.under(lab.catalog).values()) <= 5


def test_claims_whose_records_never_came_are_skipped_and_never_reused(tmp_path, meter):
    lab = catalog_of(tmp_path, 50)
    for n in (50, 51):  # two publishers that died after their claims
        (lab.catalog_dir / "sequences" / f"{n:012d}.json").write_bytes(canonical_json(
            {"model": lab.model, "sequence": n, "version": f"r{n}", "publication": f"dead-{n}"}))
    catalog = Catalog(ObjectStore(), lab.catalog, lab.model)
    assert catalog.latest().version == "r49" and catalog.top_claim == 51
    assert next_sequence(Catalog(ObjectStore(), lab.catalog, lab.model))[0] == 52
    published = lab.publish("full")  # a real publication after them: a sequence nobody held
    assert (published.version, published.sequence) == ("r52", 52)
    assert Catalog(ObjectStore(), lab.catalog, lab.model).latest().version == "r52"


def test_a_catalog_without_claims_is_listed_as_before(tmp_path, meter):
    lab = catalog_of(tmp_path, 12)
    for claim in (lab.catalog_dir / "sequences").iterdir():
        claim.unlink()
    hint_path(lab).unlink()
    (lab.catalog_dir / "junk.json").write_bytes(b'{"junk":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    os.mkfifo(lab.catalog_dir / "fifo.json")
    catalog = Catalog(ObjectStore(), lab.catalog, lab.model)
    assert catalog.latest().version == "r11" and catalog.initial().version == "r0"
    assert meter.under(lab.catalog)["list"] >= 1
    assert set(catalog.quarantined) == {"junk", "fifo"}
    assert "junk.json" in str(catalog.quarantined["junk"]) and "regular file" in str(catalog.quarantined["fifo"])


HOSTILE = {
    "deep nesting": lambda record: b'{"junk":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "UTF-16": lambda record: json.dumps(record).encode("utf-16"),
    "UTF-8 BOM": lambda record: b"\xef\xbb\xbf" + json.dumps(record).encode(),
    "not UTF-8": lambda record: json.dumps(record).encode()[:-2] + b'\xff"}',
    "FIFO": None,
}


def plant(lab: Lab, case: str) -> None:
    """r3: a claimed sequence whose record is hostile (the head hint still names r2)."""
    record = json.loads((lab.catalog_dir / "r2.json").read_bytes())
    record.update(version="r3", sequence=3, base_version="r2", base_digest=record["target_digest"])
    (lab.catalog_dir / "sequences" / f"{3:012d}.json").write_bytes(canonical_json(
        {"model": lab.model, "sequence": 3, "version": "r3", "publication": "hostile"}))
    if HOSTILE[case] is None:
        os.mkfifo(lab.catalog_dir / "r3.json")
    else:
        (lab.catalog_dir / "r3.json").write_bytes(HOSTILE[case](record))


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_no_catalog_object_jams_a_refit_or_a_rollback(lab, case, caplog):
    for kind in ("initial", "delta", "delta"):
        lab.publish(kind)
    assert refit(lab, target="r1").status == "READY"
    plant(lab, case)
    caplog.set_level(logging.WARNING, logger="canonical_refit.catalog")
    result = refit(lab)  # latest: the newest usable revision, the hostile one skipped and reported
    assert result.status == "READY" and result.version == "r2", result.error
    lab.assert_checkpoint(Path(result.checkpoint_path), "r2")
    assert any("r3" in note and "unusable" in note for note in result.notes), result.notes
    assert any("r3.json" in r.getMessage() and "quarantined" in r.getMessage() for r in caplog.records)
    result = refit(lab, target="r3")  # the hostile revision itself: a typed error naming it
    assert result.status == "FAILED" and isinstance(result.exception, CatalogError), result.error
    assert result.error_detail["revision"] == "r3" and "r3.json" in result.error_detail["file"]
    assert api.status(model=lab.model, cache_dir=lab.cache)["active"]["version"] == "r2"
    result = refit(lab, target="r1")  # a rollback past it
    assert result.status == "READY" and result.version == "r1", result.error
    lab.assert_checkpoint(Path(result.checkpoint_path), "r1")
    assert any("r3" in note for note in result.notes)
    result = refit(lab, cache=lab.root / "fresh")  # a fresh node too
    assert result.status == "READY" and result.version == "r2", result.error


def test_a_fifo_in_the_catalog_does_not_hang_the_refit_cli(prefect_api, lab, tmp_path):
    from prefect.settings import PREFECT_API_URL

    for kind in ("initial", "delta", "delta"):
        lab.publish(kind)
    plant(lab, "FIFO")
    os.mkfifo(lab.catalog_dir / "other.json")  # and one nothing names
    env = {k: v for k, v in os.environ.items() if not k.startswith("CANONICAL_REFIT_")}
    env.update(PREFECT_API_URL=PREFECT_API_URL.value(), PREFECT_HOME=str(tmp_path / "prefect-home"),
               PYTHONPATH=str(ROOT_DIR))
    base = [sys.executable, "-m", "flows.refit", "--catalog", lab.catalog, "--model", lab.model, "--cache-dir",
            str(lab.cache), "--seed-checkpoint", str(lab.launch), "--json"]
    for args, version in (([], "r2"), (["--target", "r1"], "r1")):
        proc = subprocess.run(base + args, capture_output=True, text=True, env=env, cwd=ROOT_DIR, timeout=300)
        out = json.loads(proc.stdout)
        assert proc.returncode == 0 and out["status"] == "READY" and out["version"] == version, proc.stdout
        assert any("r3" in note and "regular file" in note for note in out["notes"])
    proc = subprocess.run(base + ["--target", "r3"], capture_output=True, text=True, env=env, cwd=ROOT_DIR,
                          timeout=300)
    out = json.loads(proc.stdout)
    assert proc.returncode == 1 and out["status"] == "FAILED" and out["error_detail"]["revision"] == "r3"
    assert "regular file" in out["error"]


def test_the_catalog_benchmark_runs_and_counts_the_same_requests_at_each_length(tmp_path):
    out = tmp_path / "catalog.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.catalog", "--sizes", "4,40", "--backends", "file",
                           "--repeat", "1", "--json", str(out)], capture_output=True, text=True, cwd=ROOT_DIR,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["backends"]["file"]["catalogs"]
    assert [row["records"] for row in rows] == [4, 40]
    for operation, goal in result["backends"]["file"]["goals"].items():
        assert goal["requests"][0] == goal["requests"][1] > 0, operation
        assert isinstance(goal["met"], bool) and operation in proc.stdout
    assert "python -m benchmarks.catalog --sizes 4,40" in result["command"]
