"""How many CPU threads torch runs the command line's work on.

torch's default, a thread per core, stalls on a small machine shared with other work: every parallel op
waits for its slowest thread, and a thread whose core a busy process shares arrives late each time. One
thread does not wait on another (bench/NOTES.md, "CPU threads"); ``OMP_NUM_THREADS``, where set, is the
user's own choice and is kept.
"""
from __future__ import annotations

import os

import torch

from .errors import FastARError

DEFAULT = 1
HELP = (f"torch's CPU threads; 0: torch's default, a thread per core (default {DEFAULT}, or OMP_NUM_THREADS "
        f"where set: more threads stall on a machine whose cores other work shares)")


def set_cpu_threads(n: int | None) -> int:
    """torch's CPU threads: ``n``, 0 for torch's own default (a thread per core), None for ``DEFAULT``
    unless ``OMP_NUM_THREADS`` is set. Returns the threads torch now runs on."""
    if n is not None and n < 0:
        raise FastARError(f"--threads {n}: a count of threads, or 0 for torch's default")
    if n is None and not os.environ.get("OMP_NUM_THREADS"):
        n = DEFAULT
    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def on(device, threads: int) -> str:
    """The device in words, with its threads on a CPU: ``cpu (1 thread)``."""
    return f"{device} ({threads} thread{'s' * (threads != 1)})" if device.type == "cpu" else str(device)
