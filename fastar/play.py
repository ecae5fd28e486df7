"""Live play: a world model steered while it runs. The player's latest action is held (sticky) until the
next arrives; each chunk takes the one held when it starts and its frames go back to the player. The rows
the chunks took, as action text (``fastar.actions.actions_text``), are the session's log: it replays the session."""
from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass

import numpy as np

from .errors import FastARError
from .actions import FPS, MAX_LIVE_TEXT, ActionSpec, action_items, parse_actions


@dataclass(frozen=True)
class Taken:
    """The action a chunk took: its row, the number of the post it came from (0: none yet, idle) and the
    server's clock when the chunk took it and when that post arrived."""
    row: np.ndarray
    seq: int
    taken: float
    received: float | None


class Session:
    """One live session: ``post`` from the player's side (any thread), ``take`` once per chunk from the
    rollout's. ``token`` is the secret the player's requests must carry."""

    def __init__(self, spec: ActionSpec, fps: float = FPS):
        self.id = secrets.token_hex(8)
        self.token = secrets.token_urlsafe(24)
        self.spec, self.fps = spec, fps
        self._lock = threading.Lock()
        self._row = parse_actions("idle", spec, 1, fps)[0]
        self._seq, self._received = 0, None
        self.stopping = threading.Event()     # the player ended the session
        self.restarting = threading.Event()   # the player asked for the world from its start again
        self.paused = threading.Event()       # no chunk starts while it is set

    def read(self, action: str) -> np.ndarray:
        """One action (keys joined by ``+``, a look; no count; at most ``MAX_LIVE_TEXT`` characters) as its
        row for this world, its mouse within the world's range."""
        items = action_items(action, limit=MAX_LIVE_TEXT)
        if len(items) != 1 or items[0][1] is not None:
            raise FastARError(f"{action!r}: a live action is one item with no count, e.g. W+D or W+look(0,0.05)")
        return parse_actions(action, self.spec, 1, self.fps)[0]

    def post(self, action: str) -> tuple[int, float]:
        """Hold ``action`` from the next chunk on; its number and the time it arrived."""
        row = self.read(action)
        with self._lock:
            self._seq += 1
            self._row, self._received = row, time.perf_counter()
            return self._seq, self._received

    def take(self) -> Taken:
        """The action held now, for the chunk about to start."""
        with self._lock:
            return Taken(self._row.copy(), self._seq, time.perf_counter(), self._received)
