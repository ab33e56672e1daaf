"""Each stage counts its own object-storage requests, catalog reads included, while two stages run at once.

Fetch buckets runs beside apply deltas, on two threads. The catalog reads
through the receiver's view of object storage, resolved at each use in the
calling thread (never swapped per stage): a stage's table row counts the
requests that stage made, whichever other stage is running. A thread of no
stage (the catalog's own read pool) counts into the one stage running.
"""

from __future__ import annotations

import threading

from storage.settings import InstallerSettings, RefitParams
from tasks.receiver import Receiver


def _receiver(tmp_path) -> Receiver:
    (tmp_path / "catalog").mkdir()
    return Receiver(RefitParams(catalog=f"file://{tmp_path}/catalog", model="org/m", cache_dir=tmp_path / "cache",
                                installer=InstallerSettings(kind="none")))


def test_two_stages_on_two_threads_count_their_own_catalog_requests(tmp_path):
    rx = _receiver(tmp_path)
    both_in, errors = threading.Barrier(2, timeout=30), []

    def stage(name: str, reads: int) -> None:
        try:
            with rx.stage(name):
                both_in.wait()  # both stages are running: the second entered after the first
                for _ in range(reads):
                    assert rx.catalog.versions() == []
                both_in.wait()  # neither leaves before the other has read
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=stage, args=("fetch buckets", 3)),
               threading.Thread(target=stage, args=("apply deltas", 5))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    fetch, apply = rx.ledger.stages["fetch buckets"].requests, rx.ledger.stages["apply deltas"].requests
    assert fetch > 0 and apply > 0 and fetch * 5 == apply * 3, (fetch, apply)
    rx.close()


def test_a_thread_of_no_stage_counts_into_the_one_stage_running(tmp_path):
    rx = _receiver(tmp_path)
    with rx.stage("resolve catalog"):
        rx.catalog.versions()
    one = rx.ledger.stages["resolve catalog"].requests  # what one listing costs
    with rx.stage("fetch index"):
        rx.catalog.versions()
        pool = threading.Thread(target=rx.catalog.versions)  # as the catalog's read pool does
        pool.start()
        pool.join(60)
    assert one > 0 and rx.ledger.stages["fetch index"].requests == 2 * one
    rx.close()
