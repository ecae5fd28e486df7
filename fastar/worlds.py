"""Worlds with ground truth: a photograph is the world, the camera a square window onto it that actions
move every video frame, so every frame a world model makes has a true frame to be judged against.

Actions are encoded as Matrix-Game 2.0 encodes its own: per video frame, a multi-hot keyboard vector
(``ActionSpec.keys``) and a [pitch, yaw] mouse vector, so one action plumbing serves the pack's trained
world and Matrix-Game's checkpoints. Here W/S/A/D pan the view up/down/left/right, ``zoom_in`` /
``zoom_out`` shrink / grow it, and the mouse pans continuously (positive pitch up, positive yaw right,
about ±0.1 a frame as Matrix-Game is trained). A camera pose is (x, y, log s): the view's centre in the
photo's pixels and its side over ``view`` pixels; ``integrate`` turns actions into poses, the one rule
the ground truth and the model share.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .errors import FastARError

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
PHOTOS = os.path.join(ASSETS, "worlds")                  # train/ and heldout/ photographs (assets/LICENSE.md)
WEIGHTS = os.path.join(ASSETS, "world.safetensors")      # the pack's trained world model
DEMO_PHOTO = os.path.join(PHOTOS, "heldout", "skimage_coffee.jpg")  # held out of training

KEYS = ("W", "S", "A", "D", "zoom_in", "zoom_out")
# named mouse moves for action text: [pitch, yaw] per video frame
LOOKS = {"look_up": (0.1, 0.0), "look_down": (-0.1, 0.0), "look_left": (0.0, -0.1), "look_right": (0.0, 0.1)}


@dataclass(frozen=True)
class ActionSpec:
    """What a world's actions are and how they move its camera."""
    keys: tuple[str, ...] = KEYS
    mouse: bool = True
    pan: float = 4.0          # pixels a held W/S/A/D pans the view per video frame (at zoom 1)
    mouse_pan: float = 40.0   # pixels per unit of pitch/yaw per video frame
    mouse_limit: float = 0.12  # the largest |pitch| and |yaw| a frame the world was trained on (text beyond is refused)
    zoom: float = 1.03        # view-size factor per video frame of zoom_out (zoom_in: its inverse)
    idle: tuple[str, ...] = ()  # the keys a row without any holds (a one-hot keyboard's "no move")
    aliases: tuple[tuple[str, str], ...] = ()  # (name, what it stands for: a key or a look), e.g. GTA's A: look_left

    @property
    def width(self) -> int:
        """Numbers per video frame: the keys, then [pitch, yaw] where there is a mouse."""
        return len(self.keys) + 2 * self.mouse

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ActionSpec":
        return cls(**{**d, "keys": tuple(d["keys"]), "idle": tuple(d.get("idle", ())),
                      "aliases": tuple(tuple(a) for a in d.get("aliases", ()))})

    def motion(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per video frame (..., N, width): the screen pan (dx, dy) in pixels at zoom 1 and the change of
        log view size."""
        k = dict(zip(self.keys, actions[..., :len(self.keys)].unbind(-1)))
        zero = torch.zeros_like(actions[..., 0])
        dx = (k.get("D", zero) - k.get("A", zero)) * self.pan
        dy = (k.get("S", zero) - k.get("W", zero)) * self.pan
        if self.mouse:
            pitch, yaw = actions[..., len(self.keys)], actions[..., len(self.keys) + 1]
            dx, dy = dx + yaw * self.mouse_pan, dy - pitch * self.mouse_pan
        dlog = (k.get("zoom_out", zero) - k.get("zoom_in", zero)) * math.log(self.zoom)
        return dx, dy, dlog


def integrate(actions: torch.Tensor, spec: ActionSpec, start: torch.Tensor | None = None) -> torch.Tensor:
    """Camera poses (x, y, log s) [..., N, 3] after each video frame's action (..., N, width); frame 0's
    action moves the camera from ``start`` (default the origin, zoom 1). A pan moves the view by its own
    size's share: pixels on the screen, s times as many in the world."""
    dx, dy, dlog = spec.motion(actions.float())
    start = torch.zeros(3, device=actions.device) if start is None else start.float()
    logs = start[..., 2:3] + dlog.cumsum(-1)
    s = logs.exp()
    x = start[..., 0:1] + (dx * s).cumsum(-1)
    y = start[..., 1:2] + (dy * s).cumsum(-1)
    return torch.stack([x, y, logs], -1)


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


# -- trajectories: actions per video frame ---------------------------------------------------------------

def _frames(spec: ActionSpec, n: int, keys=(), mouse=(0.0, 0.0)) -> np.ndarray:
    a = np.zeros((n, spec.width), np.float32)
    for k in keys or spec.idle:
        a[:, spec.keys.index(k)] = 1
    if spec.mouse:
        a[:, len(spec.keys):] = mouse
    return a


def random_walk(spec: ActionSpec, n: int, rng: np.random.Generator, log_zoom: float = 0.0) -> np.ndarray:
    """Held actions of random lengths: key pans (diagonals too), mouse pans, pauses, zooms kept within
    [0.7, 1.4] of the start's size (``log_zoom``: the walk's starting log size)."""
    parts, left, logs = [], n, log_zoom
    while left > 0:
        m = int(min(left, rng.integers(4, 33)))
        kind = rng.choice(["keys", "mouse", "idle", "zoom"], p=[0.5, 0.25, 0.08, 0.17])
        if kind == "keys":
            keys = [rng.choice(["W", "S"])] if rng.random() < 0.6 else []
            keys += [rng.choice(["A", "D"])] if not keys or rng.random() < 0.5 else []
            parts.append(_frames(spec, m, keys))
        elif kind == "mouse" and spec.mouse:
            parts.append(_frames(spec, m, (), tuple(rng.uniform(-0.12, 0.12, 2))))
        elif kind == "zoom" and "zoom_in" in spec.keys:
            step = math.log(spec.zoom)
            key = "zoom_in" if logs + m * step > math.log(1.4) or (logs - m * step > math.log(0.7)
                                                                     and rng.random() < 0.5) else "zoom_out"
            m = int(min(m, max(1, (math.log(1.4) - logs) // step if key == "zoom_out"
                               else (logs - math.log(0.7)) // step)))
            logs += m * step * (1 if key == "zoom_out" else -1)
            parts.append(_frames(spec, m, [key]))
        else:
            parts.append(_frames(spec, m))
        left -= m
    return np.concatenate(parts)[:n]


def loop(spec: ActionSpec, n: int, rng: np.random.Generator, width_share: float | None = None) -> np.ndarray:
    """A rectangle of ``n`` key-held frames that ends where it began: out along two sides, back along the
    other two (another route). ``width_share``: the horizontal sides' share of the perimeter."""
    share = rng.uniform(0.25, 0.75) if width_share is None else width_share
    a = max(1, round(n * share / 2))
    b = max(0, n // 2 - a)
    h, v = ("D", "A") if rng.random() < 0.5 else ("A", "D")
    u, d = ("S", "W") if rng.random() < 0.5 else ("W", "S")
    legs = [(h, a), (u, b), (v, a), (d, b)] if rng.random() < 0.5 else [(u, b), (h, a), (d, b), (v, a)]
    out = np.concatenate([_frames(spec, m, [k]) for k, m in legs if m])
    return np.concatenate([out, _frames(spec, n - len(out))])  # an odd frame left idle


def training_actions(spec: ActionSpec, n: int, rng: np.random.Generator) -> np.ndarray:
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
    actions = np.concatenate([_frames(spec, m, keys) for keys, m in legs if m])
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


# -- action text -----------------------------------------------------------------------------------------
# Read in time linear in its length: whitespace is checked and dropped first, then one regular expression
# whose every repetition is followed by a character it cannot itself take (so no input makes it try two
# ways) reads the whole text in C; Python touches the items only once they are known to be well formed.

MAX_TEXT = 65536      # characters of action text: a schedule, a session's log or a live message
MAX_LIVE_TEXT = 256   # characters of one live action from the play page
MAX_FRAMES = 65536    # video frames one text may hold: over an hour at 16 frames a second
FPS = 16.0            # video frames a second, for counts in seconds (Wan 2.1's rate)

_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_NAME = rf"look\({_NUMBER},{_NUMBER}\)|[A-Za-z_]+"
_NAMES = rf"(?:{_NAME})(?:\+(?:{_NAME}))*"
_ITEM = rf"({_NAMES})(?:\*({_NUMBER})([fcs]?))?"
_TEXT = re.compile(rf",*{_ITEM}(?:,+{_ITEM})*,*")
_ITEMS = re.compile(_ITEM)
_LOOK = re.compile(rf"look\(({_NUMBER}),({_NUMBER})\)")
_SPACE_INSIDE = re.compile(r"[\w.)]\s+[\w.(]")  # a space inside a name, a number or between two items
_SPACE = re.compile(r"\s+")
_COUNT = re.compile(rf"\*{_NUMBER}[fcs]?")
LOOK_ANY = "look(PITCH,YAW)"  # what ``used_names`` calls every exact look


def _format(x: float) -> str:
    """A float32 as the shortest decimal that reads back to it (``look(0.03,...)``, not 0.029999999)."""
    return np.format_float_positional(np.float32(x), trim="-")


def compact(text: str, limit: int = MAX_TEXT) -> str:
    """Action text with its whitespace dropped, or refused: longer than ``limit`` characters, or spaced
    inside a name, a number or between two items (``W D``: a comma or + is missing)."""
    if len(text) > limit:
        raise FastARError(f"the action text is {len(text)} characters; at most {limit} are read")
    spaced = _SPACE_INSIDE.search(text)
    if spaced is not None:
        raise FastARError(f"cannot read {spaced.group(0).strip()!r}: a space inside a name or a number, or a "
                          f"missing comma or + between two actions")
    return _SPACE.sub("", text)


def _read(text: str, limit: int = MAX_TEXT) -> str:
    """Plain action text (not JSON) compacted and checked whole in one C-level match, or refused naming the
    item the match stopped in."""
    text = compact(text, limit)
    if _TEXT.fullmatch(text) is not None:
        return text
    if not text.strip(","):
        raise FastARError("the text holds no action; e.g. D*4, W*2")
    m = _TEXT.match(text)  # the longest readable start: the next item is the one that cannot be read
    if m is None:
        start = len(text) - len(text.lstrip(","))
    elif text[m.end() - 1] == ",":
        start = m.end()
    else:  # stopped inside the last item it read (W*2*3): name that whole item
        start = m.start(4) if m.start(4) >= 0 else m.start(1)
    depth, end = 0, start
    while end < len(text) and end - start < 40 and (text[end] != "," or depth):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        end += 1
    raise FastARError(f"cannot read {text[start:end]!r}; write KEY[+KEY]*COUNT, e.g. W+D*2 (chunks), W*6f "
                      f"(video frames) or W*1.5s (seconds)")


def action_items(text: str, limit: int = MAX_TEXT) -> list[tuple[str, str | None, str]]:
    """Action text read as (keys joined by ``+``, the count as typed or None, the unit as typed: ``f``,
    ``s``, ``c`` or none) per item, before any world's keys are checked; unreadable text is refused here."""
    stripped = text.strip()
    if not stripped.startswith("["):
        return [(m.group(1), m.group(2), m.group(3) or "") for m in _ITEMS.finditer(_read(text, limit))]
    if len(text) > limit:
        raise FastARError(f"the action text is {len(text)} characters; at most {limit} are read")
    try:
        items = [(compact(str(k)), str(int(c)), "c") for k, c in json.loads(stripped)]
    except (ValueError, TypeError, OverflowError) as exc:
        raise FastARError(f"unreadable JSON run list ({exc}); expected [[\"D\", 4], ...]") from None
    bad = [k for k, _, _ in items if re.fullmatch(_NAMES, k) is None]
    if bad:
        raise FastARError(f"cannot read {bad[0][:40]!r} in the JSON run list; write KEY[+KEY], e.g. W+D")
    if not items:
        raise FastARError("the text holds no action; e.g. D*4, W*2")
    return items


def used_names(text: str) -> set[str]:
    """Every name a readable text uses, each exact look as ``LOOK_ANY``: what a check at queue time needs,
    in C-level passes only (it runs on ComfyUI's event loop, which must not stall)."""
    if text.strip().startswith("["):
        return {name for names, _, _ in action_items(text) for name in names.split("+")}
    bare = _COUNT.sub("", _LOOK.sub("look()", _read(text)))
    return {LOOK_ANY if name == "look()" else name for name in re.split(r"[,+]", bare) if name}


def action_names(spec: ActionSpec) -> list[str]:
    """The names a world's action text knows: its keys, ``idle``, its aliases and, with a mouse, the looks
    (``look(PITCH,YAW)`` besides: a mouse move per video frame)."""
    return list(spec.keys) + ["idle"] + (list(LOOKS) if spec.mouse else []) + [a for a, _ in spec.aliases]


def frame_count(names: str, count: str | None, unit: str, chunk_video_frames: int, fps: float) -> int:
    """Video frames one item holds: ``count`` chunks (no unit, or ``c``), frames (``f``) or seconds (``s``);
    no count: one chunk."""
    if count is None:
        return chunk_video_frames
    typed = f"{names}*{count}{unit}"
    if len(count) > 12:
        raise FastARError(f"{typed[:40]}: a count of more than 12 digits")
    if unit == "s":
        frames = round(float(count) * fps)
    elif not re.fullmatch(r"\d+", count):
        raise FastARError(f"{typed}: a count of chunks or frames is a whole number (seconds take s: "
                          f"*{count}s)")
    else:
        frames = int(count) * (1 if unit == "f" else chunk_video_frames)
    if frames < 1:
        raise FastARError(f"{typed} holds no frame")
    return frames


def knows(spec: ActionSpec, name: str) -> bool:
    """Whether a world with these keys reads one action name (``LOOK_ANY`` or an exact look: any mouse)."""
    if name == LOOK_ANY or _LOOK.fullmatch(name):
        return spec.mouse
    return name.lower() in {k.lower() for k in action_names(spec)}


def _row(names: str, spec: ActionSpec) -> np.ndarray:
    """One item's keys (joined by ``+``) as a row of ``spec``: its keys and the mouse they add up to,
    refused where the mouse leaves the range the world was trained on."""
    known = action_names(spec)
    lower = {k.lower(): k for k in known}
    alias = dict(spec.aliases)
    keys, mouse = [], np.zeros(2, np.float32)
    for name in names.split("+"):
        look = _LOOK.fullmatch(name)
        if look is not None and spec.mouse:
            with np.errstate(over="ignore", invalid="ignore"):  # out of range is refused below, by name
                mouse += (float(look.group(1)), float(look.group(2)))
            continue
        key = lower.get(name.lower())
        if key is None:
            raise FastARError(f"unknown action {name[:40]!r}; this world knows {', '.join(known)}"
                              + (", look(PITCH,YAW)" if spec.mouse else ""))
        key = alias.get(key, key)
        if key in LOOKS:
            mouse += LOOKS[key]
        elif key != "idle":
            keys.append(key)
    if spec.mouse and not (np.abs(mouse) <= spec.mouse_limit).all():
        raise FastARError(f"{names[:60]}: the mouse moves [{_format(mouse[0])}, {_format(mouse[1])}] a video "
                          f"frame; this world was trained within ±{spec.mouse_limit:g} on each axis")
    return _frames(spec, 1, keys, tuple(mouse))[0]


def parse_actions(text: str, spec: ActionSpec, chunk_video_frames: int, fps: float = FPS) -> np.ndarray:
    """Action text, e.g. ``D*4, W+D*2, look_left*6f, zoom_in*1.5s, idle*2``, as actions per video frame
    [N, width]. Each item is keys joined by ``+`` (``spec.keys``, ``idle``, and with a mouse ``look_up``
    / ``look_down`` / ``look_left`` / ``look_right`` or ``look(PITCH,YAW)``), held for a count of chunks
    (``chunk_video_frames`` video frames each), of video frames with ``f``, or of seconds with ``s`` (at
    ``fps``); no count: one chunk. The JSON run-length form ``[["D", 4], ["W+D", 2]]`` (counts in
    chunks) is read too. At most ``MAX_TEXT`` characters and ``MAX_FRAMES`` video frames."""
    rows, index, ids, counts, total = [], {}, [], [], 0
    for names, count, unit in action_items(text):
        i = index.get(names)
        if i is None:
            i = index[names] = len(rows)
            rows.append(_row(names, spec))
        frames = frame_count(names, count, unit, chunk_video_frames, fps)
        total += frames
        if total > MAX_FRAMES:
            raise FastARError(f"the actions hold more than {MAX_FRAMES} video frames (68 minutes at 16 a "
                              f"second); at most {MAX_FRAMES} are played")
        ids.append(i)
        counts.append(frames)
    return np.repeat(np.stack(rows)[ids], counts, axis=0)


def runs(actions: np.ndarray, spec: ActionSpec) -> list[tuple[int, int, str]]:
    """Actions per video frame [N, width] as runs of equal rows: (first frame, end, what is held), the
    mouse as a named look where it is one, else ``look(PITCH,YAW)`` in the shortest decimals that read
    back to the same float32 (exact: the text reads back to the rows)."""
    if not len(actions):
        return []
    change = np.flatnonzero((actions[1:] != actions[:-1]).any(-1)) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [len(actions)]])
    out = []
    for i, j in zip(starts.tolist(), ends.tolist()):
        row = actions[i]
        names = [k for k, on in zip(spec.keys, row[:len(spec.keys)]) if on and k not in spec.idle]
        mouse = row[len(spec.keys):]
        if spec.mouse and mouse.any():
            named = [n for n, look in LOOKS.items() if np.array_equal(mouse, np.float32(look))]
            names.append(named[0] if named else f"look({_format(mouse[0])},{_format(mouse[1])})")
        out.append((i, j, "+".join(names) or "idle"))
    return out


def actions_text(actions: np.ndarray, spec: ActionSpec) -> str:
    """Actions per video frame [N, width] as action text that ``parse_actions`` reads back to the same
    rows: their runs, counted in video frames."""
    return ", ".join(f"{held}*{end - start}f" for start, end, held in runs(actions, spec))


# -- a flight: a trajectory over a photograph, its ground truth and the model's rollout -----------------

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


def fly(model, flight: Flight, *, cache=None, ann=None, seed: int = 0, on_chunk=None, cuda_graphs: bool = True,
        attention=None) -> torch.Tensor:
    """The world model's video [1, 3, N, view, view] of a flight: its first ``observed`` frames are the
    ground truth (cached by clean passes: what the world has shown), the rest sampled chunk by chunk,
    steered by the flight's actions, under ``cache`` (a cache config; None: TempCache at its defaults) and ``ann``.
    ``attention``: a ``FastARAttention`` subclass to run instead of the rollout's own (an experiment's
    control)."""
    from .models.world import WORLD_SAMPLING
    from .rollout import Rollout

    spec, device = model.spec, flight.truth.device
    context = spec.context(torch.from_numpy(flight.actions)[None].to(device))
    start = spec.encode(flight.truth[:, :, :flight.observed])
    ro = Rollout(model, context.to(model.dtype), frames=context.shape[1], height=spec.view, width=spec.view,
                 chunk_frames=WORLD_SAMPLING.frames_per_block, schedule=WORLD_SAMPLING.schedule(), cache=cache,
                 ann=ann, seed=seed, cuda_graphs=cuda_graphs, start=start.to(model.dtype))
    if attention is not None:
        ro.attention = attention(ro.cache)
    return spec.decode(ro.run(on_chunk).float()).clamp(-1, 1)
