"""How the installers classify engine answers and rank reports: ok, untouched (InstallError) or poisoned."""

from __future__ import annotations

import pytest

from tasks.installers.sglang_loader import FAILED, LOADING, OK, VALIDATING, LoadReport
from tasks.installers.sglang import EngineClient, Reply, judge_disk_reply, judge_loader_install
from storage.errors import InstallError

URL = "http://127.0.0.1:1"
SUCCESS = Reply(URL, True, 200, {"success": True, "message": "Success"})


def report(status: str, *, mutation_started: bool = False, rank: int = 0) -> LoadReport:
    return LoadReport("req", "r1", status=status, mutation_started=mutation_started, tp_rank=rank)


@pytest.mark.parametrize("replies, reports, expected, verdict", [
    ([SUCCESS], [report(OK)], 1, "ok"),
    ([SUCCESS, SUCCESS], [report(OK), report(OK, rank=1), report(OK)], 3, "ok"),
    # fewer ranks loaded than the engines run: one rank did not load the target
    ([SUCCESS], [report(OK)], 2, "poisoned"),
    # SGLang answers "Success" whatever the hook did: the reports decide
    ([SUCCESS], [report(FAILED)], 1, "untouched"),
    ([SUCCESS], [report(FAILED, mutation_started=True)], 1, "poisoned"),
    ([SUCCESS], [report(OK), report(FAILED, rank=1)], 2, "poisoned"),
    ([SUCCESS], [report(LOADING)], 1, "poisoned"),
    ([SUCCESS], [report(VALIDATING)], 1, "untouched"),
    ([SUCCESS], [report("unreadable")], 1, "poisoned"),
    # no rank reported: the loader never ran (not registered, no store in its environment)
    ([SUCCESS], [], 1, "untouched"),
    ([Reply(URL, True, 400, {"success": False, "message": "derived weight cache"})], [], 1, "untouched"),
    ([Reply(URL, True, 422, {"detail": []})], [], 1, "untouched"),
    ([Reply(URL, False, error="refused")], [], 1, "untouched"),
    # sent but unanswered, nothing reported yet: SGLang may still run it
    ([Reply(URL, True, error="timed out")], [], 1, "poisoned"),
    ([Reply(URL, True, error="timed out")], [report(FAILED)], 1, "poisoned"),
    # everything loaded, but the engine's answer is not SGLang's
    ([Reply(URL, True, 200, error="not JSON")], [report(OK)], 1, "poisoned"),
    ([Reply(URL, True, 400, {"success": False, "message": "cache not flushed"})], [report(OK)], 1, "poisoned"),
    # one replica unreachable, the other loaded
    ([SUCCESS, Reply(URL, False, error="refused")], [report(OK)], 1, "poisoned"),
])
def test_judge_loader_install(replies, reports, expected, verdict):
    assert judge_loader_install(replies, reports, expected)[0] == verdict


def test_the_explanation_names_each_engine_and_rank():
    _, text = judge_loader_install([SUCCESS], [], 1)
    assert URL in text and "--custom-weight-loader" in text
    _, text = judge_loader_install([SUCCESS], [LoadReport("req", "r1", status=FAILED, stage="validation",
                                                          message="wrong digest", tp_rank=1)], 1)
    assert "rank 1" in text and "wrong digest" in text


NO_DRAFT, DRAFT = {"speculative_algorithm": None}, {"speculative_algorithm": "EAGLE"}


def disk_failure(message: str) -> Reply:
    return Reply(URL, True, 400, {"success": False, "message": message, "num_paused_requests": 0})


@pytest.mark.parametrize("reply, info, verdict", [
    (Reply(URL, True, 200, {"success": True, "message": "Succeeded to update model weights."}), NO_DRAFT, "ok"),
    (Reply(URL, False, error="refused"), NO_DRAFT, "untouched"),
    (Reply(URL, True, 422, {"detail": []}), NO_DRAFT, "untouched"),
    (Reply(URL, True, 401, {"error": "Unauthorized"}), NO_DRAFT, "untouched"),
    (disk_failure("Failed to get weights iterator: no such file."), NO_DRAFT, "untouched"),
    (disk_failure("Failed to get model loader: x. | Failed to get model loader: x."), NO_DRAFT, "untouched"),
    (disk_failure("Failed to get weights iterator: no such file."), DRAFT, "poisoned"),
    (disk_failure("Failed to update weights: oom.\nRolling back to original weights."), NO_DRAFT, "poisoned"),
    (disk_failure("Failed to get model loader: x. | Failed to update weights: y."), NO_DRAFT, "poisoned"),
    (disk_failure("Weights were updated, but the cache was not flushed"), NO_DRAFT, "poisoned"),
    (Reply(URL, True, 400, {"error": {"message": "?"}}), NO_DRAFT, "poisoned"),
    (Reply(URL, True, 500, {"detail": "Internal Server Error"}), NO_DRAFT, "poisoned"),
    (Reply(URL, True, 200, error="not JSON"), NO_DRAFT, "poisoned"),
    (Reply(URL, True, 200, {"success": False, "message": "?"}), NO_DRAFT, "poisoned"),
    (Reply(URL, True, error="timed out"), NO_DRAFT, "poisoned"),
])
def test_judge_disk_reply(reply, info, verdict):
    assert judge_disk_reply(reply, info) == verdict


@pytest.mark.parametrize("url", ["127.0.0.1:30000", "ftp://127.0.0.1", "http://"])
def test_engine_urls_must_be_http(url):
    with pytest.raises(InstallError, match="engine URL"):
        EngineClient(url, 1.0)


def test_unreadable_reports_count_as_ranks_that_may_have_mutated(tmp_path):
    from tasks.installers.sglang_loader import read_reports, reports_dir
    from storage.store.local_store import LocalStore

    store = LocalStore(tmp_path, "org/name")
    folder = reports_dir(store, "req")
    folder.mkdir(parents=True)
    (folder / "a.json").write_text("{not json")
    (folder / "b.json").write_text('{"request_id": "req", "surprise": 1}')
    reports = read_reports(store, "req")
    assert len(reports) == 2 and all(r.may_have_mutated for r in reports)
    assert judge_loader_install([SUCCESS], reports, 2)[0] == "poisoned"
