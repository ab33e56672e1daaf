"""The collector pause around per-tensor work: nested, shared by threads, and always resumed."""

from __future__ import annotations

import gc
import threading

import pytest

from storage.runtime.gc_pause import gc_paused, gc_paused_call


def test_the_pause_nests_and_resumes_even_when_the_work_fails():
    assert gc.isenabled()
    with pytest.raises(ValueError):
        with gc_paused():
            assert not gc.isenabled()
            with gc_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()  # the outer pause still holds
            raise ValueError("the work failed")
    assert gc.isenabled()

    @gc_paused_call
    def failing():
        assert not gc.isenabled()
        raise KeyError("x")

    with pytest.raises(KeyError):
        failing()
    assert gc.isenabled()


def test_threads_share_one_pause_and_the_last_one_out_resumes():
    inside, release = threading.Barrier(3), threading.Event()

    def work():
        with gc_paused():
            inside.wait()
            release.wait(10)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    inside.wait()
    assert not gc.isenabled()
    release.set()
    for t in threads:
        t.join()
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off():
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
