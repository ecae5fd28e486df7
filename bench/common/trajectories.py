"""Training trajectories for the pack's world model: random walks and rectangle loops of every length, so
the camera often comes back to what it saw many chunks earlier (``world_train.py``; the tests check them)."""
from __future__ import annotations

import math

import numpy as np

from . import fastar


def random_walk(spec: fastar.actions.ActionSpec, n: int, rng: np.random.Generator, log_zoom: float = 0.0) -> np.ndarray:
    """Held actions of random lengths: key pans (diagonals too), mouse pans, pauses, zooms kept within
    [0.7, 1.4] of the start's size (``log_zoom``: the walk's starting log size)."""
    parts, left, logs = [], n, log_zoom
    while left > 0:
        m = int(min(left, rng.integers(4, 33)))
        kind = rng.choice(["keys", "mouse", "idle", "zoom"], p=[0.5, 0.25, 0.08, 0.17])
        if kind == "keys":
            keys = [rng.choice(["W", "S"])] if rng.random() < 0.6 else []
            keys += [rng.choice(["A", "D"])] if not keys or rng.random() < 0.5 else []
            parts.append(fastar.actions.held_rows(spec, m, keys))
        elif kind == "mouse" and spec.mouse:
            parts.append(fastar.actions.held_rows(spec, m, (), tuple(rng.uniform(-0.12, 0.12, 2))))
        elif kind == "zoom" and "zoom_in" in spec.keys:
            step = math.log(spec.zoom)
            key = "zoom_in" if logs + m * step > math.log(1.4) or (logs - m * step > math.log(0.7)
                                                                     and rng.random() < 0.5) else "zoom_out"
            m = int(min(m, max(1, (math.log(1.4) - logs) // step if key == "zoom_out"
                               else (logs - math.log(0.7)) // step)))
            logs += m * step * (1 if key == "zoom_out" else -1)
            parts.append(fastar.actions.held_rows(spec, m, [key]))
        else:
            parts.append(fastar.actions.held_rows(spec, m))
        left -= m
    return np.concatenate(parts)[:n]


def loop(spec: fastar.actions.ActionSpec, n: int, rng: np.random.Generator, width_share: float | None = None) -> np.ndarray:
    """A rectangle of ``n`` key-held frames that ends where it began: out along two sides, back along the
    other two (another route). ``width_share``: the horizontal sides' share of the perimeter."""
    share = rng.uniform(0.25, 0.75) if width_share is None else width_share
    a = max(1, round(n * share / 2))
    b = max(0, n // 2 - a)
    h, v = ("D", "A") if rng.random() < 0.5 else ("A", "D")
    u, d = ("S", "W") if rng.random() < 0.5 else ("W", "S")
    legs = [(h, a), (u, b), (v, a), (d, b)] if rng.random() < 0.5 else [(u, b), (h, a), (d, b), (v, a)]
    out = np.concatenate([fastar.actions.held_rows(spec, m, [k]) for k, m in legs if m])
    return np.concatenate([out, fastar.actions.held_rows(spec, n - len(out))])  # an odd frame left idle


def training_actions(spec: fastar.actions.ActionSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    """A training trajectory of ``n`` frames: random walks and loops of every length up to the whole, so
    that the camera often comes back to what it saw many chunks earlier."""
    parts, left = [], n
    while left > 0:
        if rng.random() < 0.55 and left >= 24:
            m = int(rng.integers(24, left + 1))
            parts.append(loop(spec, m, rng))
        else:
            m = int(min(left, rng.integers(8, 49)))
            parts.append(random_walk(spec, m, rng))
        left -= m
    return np.concatenate(parts)[:n]
