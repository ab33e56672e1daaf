"""The launch snapshot's non-weight files travel with every prepared checkpoint (docs/format.md, 7.3).

An engine restarted on a node's checkpoint folder needs its ``config.json``
and tokenizer, which no revision carries: every prepared checkpoint — the
seeded snapshot, a delta, a downloaded full revision and deltas after it —
holds the launch snapshot's copies, and the installed identity and the node
record name them by a digest computed here from the files themselves.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from storage.store.local_store import LocalStore
from storage.catalog.nodes import read_node_records
from storage.objects.store import ObjectStore

EXTRA = {"config.json": b'{"model_type": "llama", "hidden_size": 64}\n',
         "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE"}}\n',
         "generation_config.json": b'{"temperature": 0.7}\n'}


def digest_of(files: dict[str, bytes]) -> str:
    hashes = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    return "sha256:" + hashlib.sha256(json.dumps(dict(sorted(hashes.items())), sort_keys=True,
                                                 separators=(",", ":")).encode()).hexdigest()


def _launch_with_extras(lab) -> None:
    lab.publish("initial")
    for name, data in EXTRA.items():
        (lab.launch / name).write_bytes(data)


def _carries_them(checkpoint: Path) -> None:
    for name, data in EXTRA.items():
        assert (checkpoint / name).read_bytes() == data, name


def test_every_prepared_checkpoint_carries_the_launch_files_and_records_their_digest(lab):
    _launch_with_extras(lab)
    lab.publish("delta")
    lab.publish("full")
    lab.publish("delta")
    store = LocalStore(lab.cache, lab.model)
    expected = digest_of(EXTRA)
    for target, folder in (("r0", "full/r0"), ("r1", "materialized/r1"), ("r2", "full/r2"),
                           ("r3", "materialized/r3")):
        result = lab.run(target=target)
        assert result.status == "READY", result.error
        assert result.checkpoint_path.endswith(folder)
        _carries_them(Path(result.checkpoint_path))
        lab.assert_checkpoint(Path(result.checkpoint_path), target)
        active = store.active()
        assert active.version == target and active.launch_files == expected
        assert store.verified(target).launch_files == expected
        assert set(EXTRA) <= set(active.files)  # the file identity covers them: a changed one is noticed
    records, problems = read_node_records(ObjectStore(), lab.catalog, lab.model)
    assert not problems and [r.launch_files for r in records] == [expected]
    assert store.describe()["launch_files"]["files"] == sorted(EXTRA)


def test_a_store_that_keeps_no_launch_files_takes_them_from_the_seed_at_its_next_run(lab):
    _launch_with_extras(lab)
    lab.publish("delta")
    assert lab.run(target="r0").status == "READY"
    store = LocalStore(lab.cache, lab.model)
    shutil.rmtree(store.root / "launch-files")  # a store seeded by a release that kept none
    (store.root / "launch-files.json").unlink()
    result = lab.run(target="r1")
    assert result.status == "READY", result.error
    _carries_them(Path(result.checkpoint_path))
    assert store.active().launch_files == digest_of(EXTRA)
    assert any("non-weight files" in note for note in result.notes)


def test_weights_of_other_formats_are_not_carried(lab):
    lab.publish("initial")
    (lab.launch / "pytorch_model.bin").write_bytes(b"\0" * 1024)  # a second copy of the weights
    (lab.launch / "tokenizer.json").write_bytes(EXTRA["tokenizer.json"])
    lab.publish("delta")
    result = lab.run()
    assert result.status == "READY", result.error
    checkpoint = Path(result.checkpoint_path)
    assert (checkpoint / "tokenizer.json").is_file()
    kept = json.loads((LocalStore(lab.cache, lab.model).root / "launch-files.json").read_text())
    assert "pytorch_model.bin" not in kept["files"] and "model.safetensors.index.json" not in kept["files"]
    assert set(kept["files"]) == {"config.json", "tokenizer.json"}
