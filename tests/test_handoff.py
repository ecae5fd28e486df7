"""The hand-off that shows (or writes) chunk k while chunk k + 1 samples: items done in order, off the
caller's thread, at most one waiting while one is at work, the worker's error raised to the caller, and the
inline mode the same work on the caller's thread."""
import threading
import time

import pytest
import torch

from comfyui_fastar.nodes.handoff import Handoff


def test_items_are_done_in_order_on_a_worker_while_the_caller_goes_on():
    done, threads, gate = [], set(), threading.Event()

    def work(i, t):
        gate.wait(5)
        threads.add(threading.get_ident())
        done.append((i, t.sum().item()))

    h = Handoff(work)
    t0 = time.perf_counter()
    h.put(0, torch.ones(2))   # taken by the worker, which waits at the gate
    time.sleep(0.05)
    h.put(1, torch.ones(3))   # waits in the queue of one: the caller is not held
    assert time.perf_counter() - t0 < 1.0 and done == []
    blocked = threading.Thread(target=lambda: h.put(2, torch.ones(4)))
    blocked.start()
    time.sleep(0.1)
    assert blocked.is_alive()  # a third is held back: one at work, one waiting
    gate.set()
    blocked.join(5)
    h.close()
    assert done == [(0, 2.0), (1, 3.0), (2, 4.0)] and threading.get_ident() not in threads


def test_the_workers_error_reaches_the_caller_and_later_items_are_dropped():
    done = []

    def work(i):
        if i == 1:
            raise ValueError("bad chunk")
        done.append(i)

    h = Handoff(work)
    h.put(0)
    h.put(1)
    with pytest.raises(ValueError, match="bad chunk"):
        h.drain()
    h.put(2)  # after an error nothing more is done
    h.close()
    assert done == [0]


def test_inline_is_the_same_work_on_the_callers_thread():
    seen = []
    h = Handoff(lambda i: seen.append((i, threading.get_ident())), threaded=False)
    for i in range(3):
        h.put(i)
    h.close()
    assert seen == [(i, threading.get_ident()) for i in range(3)]


def test_the_worker_keeps_the_callers_inference_mode():
    modes = []
    with torch.inference_mode():
        h = Handoff(lambda: modes.append(torch.is_inference_mode_enabled()))
    h.put()
    h.close()
    assert modes == [True]
