"""Work on a finished chunk done while the next chunk samples: decoding, encoding, sending or writing its
frames (the nodes), or moving its K/V to the memory tier's host archive (``fastar.recall``), runs in a
worker thread (on CUDA, on its own stream), handed over through a queue of one, so a worker slower than
sampling slows sampling rather than growing memory."""
from __future__ import annotations

import queue
import threading

import torch

from .replay import CAPTURE_LOCK

PIPELINED = True
"""Chunk k decoded, encoded, sent or written while chunk k + 1 samples; False: one after the other, the
loop the benchmarks compare against."""


class Handoff:
    """``work(*item)`` for each ``put(*item)``, in order, in a worker thread: one item waiting and one at
    work at most (``put`` blocks beyond that). Tensors handed over are the caller's no more: on CUDA the
    worker's stream waits for the work that made them. ``threaded=False`` (by default where ``PIPELINED``
    is off) runs ``work`` inline. The worker's error surfaces in the caller's next ``put``, ``drain`` or
    ``close``; after one, the remaining items are dropped. ComfyUI's ops take its Cancel in whichever
    thread runs them, the worker's too: taken inside ``finish``, every item handed over is still done and
    the Cancel is raised to the caller after its next ``put`` (that item handed over first), ``drain`` or
    ``close``, where the sampling stops as it would have; taken elsewhere, it is raised as an error is."""

    def __init__(self, work, device: torch.device | str | None = None, threaded: bool | None = None,
                 name: str = "fastar-handoff"):
        threaded = PIPELINED if threaded is None else threaded
        self.work, self.error, self.cancel, self.failed = work, None, None, False
        self.queue: queue.Queue = queue.Queue(maxsize=1)
        cuda = threaded and device is not None and torch.device(device).type == "cuda"
        self.stream = torch.cuda.Stream(torch.device(device)) if cuda else None
        self.inference = torch.is_inference_mode_enabled()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True) if threaded else None
        if self.thread is not None:
            self.thread.start()

    def put(self, *item) -> None:
        self._raise()
        if self.thread is None:
            self.work(*item)
            return
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record()
            for t in item:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(self.stream)
        self.queue.put((item, event))
        self._raise(cancel=True)

    def _loop(self) -> None:
        _local.handoff = self
        with torch.inference_mode(self.inference):
            while True:
                got = self.queue.get()
                try:
                    if got is None:
                        return
                    if not self.failed:
                        self._run(*got)
                except BaseException as exc:  # the caller re-raises it
                    self.failed, self.error = True, exc
                finally:
                    got = None  # nothing handed over outlives its work here
                    self.queue.task_done()

    def _run(self, item, event) -> None:
        with CAPTURE_LOCK:  # never while the sampling captures a CUDA graph
            if self.stream is None:
                self.work(*item)
                return
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(event)
                self.work(*item)
            self.stream.synchronize()

    def _raise(self, cancel: bool = False) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        if cancel and self.cancel is not None:
            error, self.cancel = self.cancel, None
            raise error

    def drain(self) -> None:
        """Returns once every item put is done."""
        if self.thread is not None:
            self.queue.join()
        self._raise(cancel=True)

    def close(self, raising: bool = True) -> None:
        """Every item put done, then the worker ends (``raising=False``: its error or Cancel, if any, is
        dropped, as when the caller already has one of its own)."""
        if self.thread is not None and self.thread.is_alive():
            self.queue.put(None)
            if threading.current_thread() is not self.thread:  # a finalizer its work set off ends it there
                self.thread.join()
        if raising:
            self._raise(cancel=True)


_local = threading.local()


def finish(run, state):
    """``run()``, which in a ``Handoff`` worker no ComfyUI Cancel stops half-way: a Cancel its ops take
    puts back what ``run`` changed (``state.restore(saved)``, ``saved = state.state()`` read before it),
    runs it again, and is kept for the worker's caller. The item's earlier steps are not redone, so
    ``run`` is one step of an item (a latent frame's decode). On any other thread a Cancel stops ``run``
    as ComfyUI's stops anything."""
    worker = getattr(_local, "handoff", None)
    while True:
        saved = state.state() if worker is not None else None
        try:
            return run()
        except BaseException as exc:
            if worker is None or type(exc).__name__ != "InterruptProcessingException":  # its module differs
                raise                                                                   # by ComfyUI version
            state.restore(saved)
            worker.cancel = exc
