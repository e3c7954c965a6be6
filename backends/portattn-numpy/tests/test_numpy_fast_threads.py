"""Thread count: code setting, environment variable, machine default, bad values."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from portattn_numpy import (
    THREADS_ENV,
    _run,
    _threads,
    configured,
    get_num_threads,
    set_num_threads,
)

from portattn import attention


def _machine() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def test_default_follows_the_machine(monkeypatch, threads):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert get_num_threads() == _machine()


def test_environment_variable(monkeypatch, threads):
    monkeypatch.setenv(THREADS_ENV, "3")
    assert get_num_threads() == 3


def test_code_setting_wins_over_environment(monkeypatch, threads):
    monkeypatch.setenv(THREADS_ENV, "3")
    threads(5)
    assert get_num_threads() == 5
    threads(None)
    assert get_num_threads() == 3


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_bad_environment_value_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv(THREADS_ENV, value)
    q = np.ones((1, 2, 4), np.float32)
    with pytest.raises(ValueError, match=f"{THREADS_ENV} must be a positive integer; got "
                                         f"{THREADS_ENV}='{value}'"):
        attention(q, q, q, kernel="numpy_fast")


@pytest.mark.parametrize("value", [0, -1, 2.0, True, "x"])
def test_bad_code_setting_is_a_clear_error(value):
    with pytest.raises(ValueError, match="count must be a positive integer"):
        set_num_threads(value)
    assert get_num_threads() >= 1  # the bad value was not kept


def _thread_ids() -> set[int]:
    seen: set[int] = set()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 300, 16)).astype(np.float32)
    with configured(on_tile=lambda *_: seen.add(threading.get_ident())):
        attention(q, q, q, kernel="numpy_fast")
    return seen


def test_small_calls_stay_in_the_caller(threads):
    threads(4)
    seen: set[int] = set()
    q = np.ones((1, 8, 64, 16), np.float32)  # 8 units, far too little work to share
    with configured(on_tile=lambda *_: seen.add(threading.get_ident())):
        attention(q, q, q, kernel="numpy_fast")
    assert seen == {threading.get_ident()}


def test_one_thread_runs_in_the_caller(threads):
    threads(1)
    assert _thread_ids() == {threading.get_ident()}


def test_work_stays_within_the_thread_count(threads):
    threads(3)
    assert 1 <= len(_thread_ids()) <= 3


def test_blas_is_held_to_one_thread_inside(threads):
    from threadpoolctl import threadpool_info

    # the BLAS libraries loaded when the kernel first ran (NumPy's among them)
    q = np.ones((1, 4, 64, 8), np.float32)
    attention(q, q, q, kernel="numpy_fast")
    paths = {c.filepath for c in _threads._blas_libraries()}

    def blas_threads() -> list[int]:
        return [i["num_threads"] for i in threadpool_info() if i["filepath"] in paths]

    seen: list[int] = []
    threads(2)
    before = blas_threads()
    with configured(on_tile=lambda *_: seen or seen.extend(blas_threads())):
        attention(q, q, q, kernel="numpy_fast")
    assert seen
    assert set(seen) == {1}
    assert blas_threads() == before  # and given back afterwards


def test_concurrent_calls_keep_blas_on_one_thread_until_the_last_leaves(threads):
    def blas_threads() -> set[int]:  # asked of the libraries themselves, each time
        return {library.num_threads for library in _threads._blas_libraries()}

    before = blas_threads()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[set[int]] = []

    def first() -> None:
        with _threads._blas_single_threaded():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second() -> None:
        first_in.wait(10)
        with _threads._blas_single_threaded():
            second_in.set()
            first_out.wait(10)
            seen.append(blas_threads())  # the first call has left, this one has not

    workers = [threading.Thread(target=f) for f in (first, second)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(20)
    assert seen == [{1}]
    assert blas_threads() == before


def test_blas_is_held_to_one_thread_in_calls_from_other_threads(threads):
    q = np.ones((1, 4, 64, 8), np.float32)
    attention(q, q, q, kernel="numpy_fast")  # this thread has set BLAS's count before
    seen: list[int] = []
    threads(2)

    def call() -> None:
        with configured(on_tile=lambda *_: seen.extend(
                library.num_threads for library in _threads._blas_libraries())):
            attention(q, q, q, kernel="numpy_fast")

    worker = threading.Thread(target=call)
    worker.start()
    worker.join(60)
    assert seen
    assert set(seen) == {1}


def test_same_results_from_any_thread_while_others_call(threads):
    threads(2)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 4, 300, 64)).astype(np.float32) for _ in range(3))
    alone = attention(q, k, v, kernel="numpy_fast")
    results: list[np.ndarray] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            for _ in range(3):
                results.append(attention(q, k, v, kernel="numpy_fast"))
        except BaseException as e:  # reported below
            errors.append(e)

    workers = [threading.Thread(target=call) for _ in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert not errors
    assert len(results) == 24
    assert all(np.array_equal(r, alone) for r in results)


def test_changing_the_thread_count_during_calls(threads):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 4, 512, 8)).astype(np.float32)  # work for the pool
    errors: list[BaseException] = []
    stop = threading.Event()

    def call() -> None:
        try:
            while not stop.is_set():
                attention(q, q, q, kernel="numpy_fast")
        except BaseException as e:  # reported below
            errors.append(e)

    workers = [threading.Thread(target=call) for _ in range(4)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and not errors:
        for count in (2, 3):
            set_num_threads(count)
            time.sleep(0.001)
    stop.set()
    for w in workers:
        w.join(60)
    assert not errors, errors


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_gets_its_own_pool(threads):
    import warnings

    threads(2)
    q = np.ones((1, 4, 512, 8), np.float32)  # enough work for two threads
    attention(q, q, q, kernel="numpy_fast")  # the parent's pool threads exist now
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads, 3.12+
        warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)  # JAX, if imported
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            attention(q, q, q, kernel="numpy_fast")
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert done[0] == pid, "the child hung in attention after fork"
    assert os.waitstatus_to_exitcode(done[1]) == 0


def _units_and_threads(monkeypatch, q_shape, kv_len):
    """A call's units, and the threads it hands them to. (Whether a helper wakes in time
    to take one is the scheduler's affair: on a busy machine the caller may take all.)"""
    rng = np.random.default_rng(0)
    q = rng.standard_normal(q_shape).astype(np.float32)
    k = rng.standard_normal((*q_shape[:2], kv_len, q_shape[3])).astype(np.float32)
    units, asked = [], []
    real = _run.run_parallel

    def run_parallel(worker, work, count):
        asked.append(min(count, len(work)))
        real(worker, work, count)

    with monkeypatch.context() as patch, configured(
            on_unit=lambda *_: units.append(threading.get_ident())):
        patch.setattr(_run, "run_parallel", run_parallel)
        attention(q, k, k, kernel="numpy_fast")
    assert len(set(units)) <= asked[0]
    return len(units), asked[0]


def test_stacked_heads_are_shared_out_when_the_work_fills_two_threads(monkeypatch, threads):
    threads(2)
    # 32 heads of 128 x 128 fit one stacked unit; their 2^19 scores fill two threads
    assert _units_and_threads(monkeypatch, (1, 32, 128, 64), 128) == (2, 2)
    threads(1)
    assert _units_and_threads(monkeypatch, (1, 32, 128, 64), 128) == (1, 1)
    threads(2)
    # 2^15 scores: one thread
    assert _units_and_threads(monkeypatch, (1, 8, 64, 64), 64)[1] == 1


def test_a_decode_step_is_shared_out_by_the_cache_it_reads(monkeypatch, threads):
    threads(2)
    # one query row: few scores, but every key and value row is read
    assert _units_and_threads(monkeypatch, (1, 32, 1, 128), 4096)[1] == 2
    assert _units_and_threads(monkeypatch, (1, 8, 1, 64), 4096)[1] == 1
