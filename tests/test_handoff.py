"""The hand-off that shows (or writes) chunk k while chunk k + 1 samples: items done in order, off the
caller's thread, at most one waiting while one is at work, the worker's error raised to the caller, and the
inline mode the same work on the caller's thread."""
import threading
import time

import pytest
import torch

from comfyui_fastar.fastar.handoff import Handoff


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


class InterruptProcessingException(Exception):
    """ComfyUI's Cancel, as its ops raise it (by name: its module differs by version)."""


def test_a_cancel_the_workers_ops_take_outside_finish_stops_it_as_an_error_does():
    done = []

    def work(i):
        if i == 1:
            raise InterruptProcessingException()
        done.append(i)

    h = Handoff(work)
    h.put(0)
    h.put(1)
    with pytest.raises(InterruptProcessingException):
        h.drain()
    h.put(2)  # after it nothing more is done
    h.close()
    assert done == [0]


def test_a_cancel_taken_inside_finish_finishes_every_item_and_reaches_the_caller_once():
    """A cancel that a step run through ``finish`` takes on the worker: the step's memory is put back and
    the step run again, every item handed over is done as without the cancel, and the cancel is raised to
    the caller once (at a ``put``, after its item is handed over, or at ``close``). Off the worker the same
    cancel stops the step."""
    from comfyui_fastar.fastar.handoff import finish

    class Decoder:  # a running sum: its memory is what a redone step must not count twice
        def __init__(self, cancel_at):
            self.total, self.cancels = 0, [cancel_at]

        def state(self):
            return self.total

        def restore(self, total):
            self.total = total

        def step(self, i, j):
            self.total += 10 * i + j
            if (i, j) in self.cancels:
                self.cancels.remove((i, j))
                raise InterruptProcessingException()
            return self.total

    decoder, done, raised = Decoder((1, 1)), [], []

    def work(i):
        done.append([finish(lambda: decoder.step(i, j), decoder) for j in range(3)])

    h = Handoff(work)
    for i in range(4):
        try:
            h.put(i)
        except InterruptProcessingException:
            raised.append(i)
    try:
        h.close()
    except InterruptProcessingException:
        raised.append("close")
    expected, total = [], 0
    for i in range(4):
        expected.append([total := total + 10 * i + j for j in range(3)])
    assert done == expected and len(raised) == 1 and raised != [0]
    inline = Decoder((0, 0))
    with pytest.raises(InterruptProcessingException):
        finish(lambda: inline.step(0, 0), inline)


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


def test_the_worker_and_a_graph_capture_never_overlap():
    """The worker holds the capture lock while it works, so a CUDA graph capture waits for it (and it for one)."""
    from comfyui_fastar.fastar.replay import CAPTURE_LOCK
    held, gate = [], threading.Event()
    h = Handoff(lambda: (held.append(CAPTURE_LOCK.locked()), gate.wait(5)))
    h.put()
    time.sleep(0.05)
    assert not CAPTURE_LOCK.acquire(timeout=0.1)  # the capture would wait
    gate.set()
    assert CAPTURE_LOCK.acquire(timeout=5)
    CAPTURE_LOCK.release()
    h.close()
    assert held == [True]


@pytest.mark.cuda
def test_graphs_capture_while_a_worker_decodes_beside_them():
    """A worker that allocates, frees the allocator's cache and synchronizes (as a VAE's decode through
    ComfyUI does) while the caller captures a new CUDA graph every time: each capture holds and replays right."""
    from comfyui_fastar.fastar.replay import ReplayGraph

    def work(x):
        for _ in range(4):
            y = torch.randn(512, 512, device="cuda") @ x[:512, :512]
            del y
            torch.cuda.empty_cache()
        torch.cuda.synchronize()

    a = torch.randn(64, 64, device="cuda")
    a @ a  # cuBLAS set up on this thread first, as the sampling's first chunk does before any hand-off (two
    #        threads' first cuBLAS calls at once can fail: CUBLAS_STATUS_NOT_INITIALIZED)
    torch.cuda.synchronize()
    h, graph = Handoff(work, "cuda"), ReplayGraph()
    for key in range(24):
        h.put(torch.randn(1024, 1024, device="cuda"))
        out = graph.run(key, lambda: (torch.empty_like(a),), lambda b: b @ b + key, lambda b: b.copy_(a))
        torch.testing.assert_close(out, a @ a + key)
    h.close()
