"""The seed's quota check counts the bytes it writes: a weight file it hard-links from the launch snapshot
writes none and, sharing its bytes with the launch folder, takes none of the store's quota; a copy counts at
its size. Whether the seed links is a setting (``seed_links``; ``--no-seed-links``,
``CANONICAL_REFIT_SEED_LINKS=0``)."""

from __future__ import annotations

import os

from flows.cli import _run_parser, build_params
from storage.settings import RefitParams
from storage.store.quota import held_size


def test_a_linked_seed_fits_a_quota_smaller_than_the_model_and_a_copied_one_does_not(lab):
    lab.publish("initial")
    model = sum(p.stat().st_size for p in lab.launch.iterdir())
    quota_gb = 4096 / 1e9  # room for the launch snapshot's config, far less than its weights
    assert quota_gb * 1e9 < model / 10

    copied = lab.run(target="r0", cache_max_gb=quota_gb, seed_links=False, cache_dir=lab.root / "copy")
    assert copied.status == "FAILED" and copied.error_detail["type"] == "CapacityError"
    assert f"seeding r0 needs {model:,} more bytes" in copied.error  # every byte copied, counted

    linked = lab.run(target="r0", cache_max_gb=quota_gb)
    assert linked.status == "READY", linked.error
    assert any("hard link" in note for note in linked.notes)
    full = lab.store_root / "full" / "r0"
    weights = [p for p in full.iterdir() if p.suffix == ".safetensors"]
    assert weights and all(p.stat().st_nlink == 2 for p in weights)  # a second name for the launch bytes
    assert held_size(lab.store_root) < quota_gb * 1e9  # the linked bytes are the launch folder's too

    for path in lab.launch.iterdir():  # the launch folder goes: the store alone holds those bytes now
        path.unlink()
    assert held_size(lab.store_root) >= sum(p.stat().st_size for p in weights)


def test_seed_links_is_a_setting_read_from_its_flag_and_its_environment_variable(lab, monkeypatch):
    assert RefitParams(catalog="file:///srv/catalog", model="org/name").seed_links is True
    args = ["--catalog", "file:///srv/catalog", "--model", "org/name", "--no-seed-links"]
    assert build_params(_run_parser().parse_args(args)).seed_links is False
    monkeypatch.setenv("CANONICAL_REFIT_SEED_LINKS", "0")  # as before it was a setting
    assert RefitParams(catalog="file:///srv/catalog", model="org/name").seed_links is False

    lab.publish("initial")
    result = lab.run(target="r0")  # the environment decides: copied
    assert result.status == "READY" and not any("hard link" in note for note in result.notes), result.notes
    launch = {p.name: os.stat(p).st_ino for p in lab.launch.iterdir()}
    full = lab.store_root / "full" / "r0"
    assert all(os.stat(full / name).st_ino != inode for name, inode in launch.items())
