"""Photographs as worlds with ground truth: the camera is a square window onto a photograph that actions
move every video frame (``fastar.actions``), so every frame a world model makes has a true frame to be
judged against. Poses, rendering, scripted routes that come back to a place, and flights: a route over a
photograph, its ground truth and the world model's rollout.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .actions import ActionSpec, held_rows, integrate
from .errors import FastARError
from .rollout import Rollout

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
PHOTOS = os.path.join(ASSETS, "worlds")                  # train/ and heldout/ photographs (assets/LICENSE.md)
WEIGHTS = os.path.join(ASSETS, "world.safetensors")      # the pack's trained world model
DEMO_PHOTO = os.path.join(PHOTOS, "heldout", "skimage_coffee.jpg")  # held out of training


def load_photo(path, device=None) -> torch.Tensor:
    """A photograph as a world: [3, H, W] float in [0, 1]."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            a = np.asarray(im.convert("RGB"), dtype=np.uint8)
    except (OSError, ValueError) as exc:
        raise FastARError(f"cannot read the world photograph {path}: {exc}") from None
    return torch.from_numpy(a.copy()).permute(2, 0, 1).float().div(255).to(device)


def render(photo: torch.Tensor, poses: torch.Tensor, view: int) -> torch.Tensor:
    """The camera's frames [N, 3, view, view] in [-1, 1] at poses [N, 3] over ``photo`` [3, H, W] in
    [0, 1]: bilinear, black outside the photograph."""
    _, h, w = photo.shape
    x, y, s = poses[:, 0], poses[:, 1], poses[:, 2].exp()
    theta = torch.zeros(len(poses), 2, 3, device=photo.device)
    theta[:, 0, 0] = s * view / w
    theta[:, 1, 1] = s * view / h
    theta[:, 0, 2] = 2 * x / w - 1
    theta[:, 1, 2] = 2 * y / h - 1
    grid = F.affine_grid(theta, [len(poses), 3, view, view], align_corners=False)
    frames = F.grid_sample(photo[None].expand(len(poses), -1, -1, -1), grid.to(photo.dtype),
                           mode="bilinear", padding_mode="zeros", align_corners=False)
    return frames * 2 - 1


def extent(poses: torch.Tensor, view: int) -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1): the photo area a trajectory's views cover."""
    half = poses[:, 2].exp() * view / 2
    return ((poses[:, 0] - half).min().item(), (poses[:, 1] - half).min().item(),
            (poses[:, 0] + half).max().item(), (poses[:, 1] + half).max().item())


def place(poses: torch.Tensor, hw: tuple[int, int], view: int, rng: np.random.Generator,
          margin: float = 1.0) -> torch.Tensor | None:
    """``poses`` (from the origin) moved so every view lies inside a photo of ``hw`` (a random spot where
    there is room); None where the trajectory does not fit."""
    x0, y0, x1, y1 = extent(poses, view)
    room_x, room_y = hw[1] - 2 * margin - (x1 - x0), hw[0] - 2 * margin - (y1 - y0)
    if room_x < 0 or room_y < 0:
        return None
    ox = margin - x0 + rng.uniform(0, room_x)
    oy = margin - y0 + rng.uniform(0, room_y)
    return poses + torch.tensor([ox, oy, 0.0], dtype=poses.dtype)


@dataclass(frozen=True)
class Revisit:
    """A scripted trajectory that comes back to a place seen ``n`` video frames earlier by another route:
    a lead-in away from the start (so the sink does not hold the place), a loop of ``n`` frames, then
    ``frames_after`` frames retracing the loop's first leg, which show what the loop's start showed."""
    actions: np.ndarray
    n: int
    lead_in: int
    frames_after: int

    @property
    def revisit(self) -> range:
        """The video frames that revisit (seen exactly ``n`` frames before)."""
        start = self.lead_in + self.n
        return range(start, start + self.frames_after)


def revisit_actions(spec: ActionSpec, n: int, hw: tuple[int, int], view: int, rng: np.random.Generator,
                    lead_in: int = 24, frames_after: int = 12) -> Revisit:
    """``Revisit`` over a photo of ``hw``: a lead-in down and to one side, a rectangle loop of ``n`` frames
    (out to the other side and up, back across and down), then the loop's first leg again; key pans,
    slowed with the mouse where the loop at full speed would not fit the photograph."""
    first = str(rng.choice(["D", "A"]))
    back = {"D": "A", "A": "D"}[first]
    b = max(1, round(n * 0.1))  # a long, low rectangle: its far side takes the place out of view
    a = n // 2 - b
    legs = [((back, "S"), lead_in), ((first,), a), (("W",), b), ((back,), a), (("S",), b),
            ((), n - 2 * a - 2 * b), ((first,), frames_after)]
    actions = np.concatenate([held_rows(spec, m, keys) for keys, m in legs if m])
    x0, y0, x1, y1 = extent(integrate(torch.from_numpy(actions), spec), view)
    # the views' extent is the route's plus a view: slow the route until it fits (place's margin of 1 px and a
    # pixel to spare)
    shrink = min(1.0, (hw[1] - 3 - view) / (x1 - x0 - view), (hw[0] - 3 - view) / (y1 - y0 - view))
    if shrink < 1.0:
        if not spec.mouse:
            raise FastARError(f"a loop of {n} frames does not fit a {hw[1]}x{hw[0]} photograph")
        # the same route at a slower pan: the pans become mouse moves
        dx, dy, _ = spec.motion(torch.from_numpy(actions))
        actions = np.zeros_like(actions)
        actions[:, len(spec.keys)] = (-dy * shrink / spec.mouse_pan).numpy()
        actions[:, len(spec.keys) + 1] = (dx * shrink / spec.mouse_pan).numpy()
    return Revisit(actions.astype(np.float32), n, lead_in, frames_after)


@dataclass
class Flight:
    """A camera's trajectory over a photograph: its actions [N, width] per video frame, poses [N, 3],
    ground truth [1, 3, N, view, view] in [-1, 1], how many of its first video frames the model is shown
    (``observed``: the world's past, cached before the first chunk) and, for an out-and-back, the frames
    that revisit a place (``revisit``)."""
    actions: np.ndarray
    poses: torch.Tensor
    truth: torch.Tensor
    observed: int
    revisit: range | None = None


def flight(photo: torch.Tensor, actions: np.ndarray, view: int, observed: int, rng: np.random.Generator,
           revisit: range | None = None, spec: ActionSpec = ActionSpec()) -> Flight:
    """The ``Flight`` of ``actions`` over ``photo`` [3, H, W], placed at a random spot where every view
    fits (``FastARError`` where none does)."""
    poses = place(integrate(torch.from_numpy(actions), spec), tuple(photo.shape[1:]), view, rng)
    if poses is None:
        x0, y0, x1, y1 = extent(integrate(torch.from_numpy(actions), spec), view)
        raise FastARError(f"the actions' views span {x1 - x0:.0f}x{y1 - y0:.0f} px, more than the "
                          f"{photo.shape[2]}x{photo.shape[1]} photograph: pan less, or zoom in")
    truth = render(photo, poses.to(photo.device), view).transpose(0, 1)[None]
    return Flight(actions, poses, truth, observed, revisit)


def flight_rollout(model, flight: Flight, *, cache=None, ann=None, seed: int = 0,
                   cuda_graphs: bool = True) -> Rollout:
    """The world model's rollout of a flight: its first ``observed`` frames are the ground truth (cached by
    clean passes: what the world has shown), the rest sampled chunk by chunk, steered by the flight's
    actions, under ``cache`` (a cache config; None: TempCache at its defaults) and ``ann``."""
    spec = model.spec
    context = spec.context(torch.from_numpy(flight.actions)[None].to(flight.truth.device))
    return model.rollout(context, spec.encode(flight.truth[:, :, :flight.observed]), cache=cache, ann=ann, seed=seed,
                         cuda_graphs=cuda_graphs)


def fly(model, flight: Flight, *, cache=None, ann=None, seed: int = 0, on_chunk=None,
        cuda_graphs: bool = True) -> torch.Tensor:
    """The world model's video [1, 3, N, view, view] of a flight (``flight_rollout``'s frames, decoded)."""
    ro = flight_rollout(model, flight, cache=cache, ann=ann, seed=seed, cuda_graphs=cuda_graphs)
    return model.spec.decode(ro.run(on_chunk).float()).clamp(-1, 1)
