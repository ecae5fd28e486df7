"""Actions as Matrix-Game 2.0 encodes its own, and action text both ways.

Per video frame, a multi-hot keyboard vector (``ActionSpec.keys``) and a [pitch, yaw] mouse vector, so
one action plumbing serves the pack's trained world and Matrix-Game's checkpoints. In the pack's world
W/S/A/D pan the view up/down/left/right, ``zoom_in`` / ``zoom_out`` shrink / grow it, and the mouse pans
continuously (positive pitch up, positive yaw right, about ±0.1 a frame as Matrix-Game is trained). A
camera pose is (x, y, log s): the view's centre in the photo's pixels and its side over ``view`` pixels;
``integrate`` turns actions into poses, the one rule the ground truth and the model share. Action text
(``parse_actions``, ``actions_text``) is how a schedule, a session's log and the CLI write actions.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass

import numpy as np
import torch

from .errors import FastARError

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


def held_rows(spec: ActionSpec, n: int, keys=(), mouse=(0.0, 0.0)) -> np.ndarray:
    """``n`` rows of actions [n, width] holding ``keys`` (none: the idle keys) and the mouse at ``mouse``."""
    a = np.zeros((n, spec.width), np.float32)
    for k in keys or spec.idle:
        a[:, spec.keys.index(k)] = 1
    if spec.mouse:
        a[:, len(spec.keys):] = mouse
    return a


def action_table(spec: ActionSpec, n: int, rows: np.ndarray | None) -> np.ndarray:
    """A rollout's n action rows [n, width]: ``rows`` (a schedule's), the last held to the end of the last
    chunk; None: idle, to be written live."""
    table = np.repeat(held_rows(spec, 1), n, 0)
    if rows is not None:
        table[:min(n, len(rows))] = rows[:n]
        table[len(rows):] = rows[-1]
    return table


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
_TEXT = re.compile(rf"(?:{_NAMES})(?:\*{_NUMBER}[fcs]?)?(?:,+(?:{_NAMES})(?:\*{_NUMBER}[fcs]?)?)*")
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
    """Action text with its whitespace and its outer commas dropped, or refused: longer than ``limit``
    characters, or spaced inside a name, a number or between two items (``W D``: a comma or + is missing)."""
    if len(text) > limit:
        raise FastARError(f"the action text is {len(text)} characters; at most {limit} are read")
    spaced = _SPACE_INSIDE.search(text)
    if spaced is not None:
        raise FastARError(f"cannot read {spaced.group(0).strip()!r}: a space inside a name or a number, or a "
                          f"missing comma or + between two actions")
    return _SPACE.sub("", text).strip(",")


def _read(text: str, limit: int = MAX_TEXT) -> str:
    """Plain action text (not JSON) compacted and checked whole in one C-level match, or refused naming the
    item the match stopped in."""
    text = compact(text, limit)
    m = _TEXT.match(text)  # greedy over items that read one way only: the longest readable start
    if m is not None and m.end() == len(text):
        return text
    if not text:
        raise FastARError("the text holds no action; e.g. D*4, W*2")
    if m is None:
        start = 0
    elif text[m.end()] == ",":  # the item after these commas is the one that cannot be read
        start = len(text) - len(text[m.end():].lstrip(","))
    else:  # stopped inside the last item it read (W*2*3): name that whole item, a look's comma not a boundary
        start = text.rfind(",", 0, m.end()) + 1
        while start > 0 and text.count(")", start, m.end()) > text.count("(", start, m.end()):
            start = text.rfind(",", 0, start - 1) + 1
    depth, end = 0, start
    while end < len(text) and end - start < 40 and (text[end] != "," or depth):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        end += 1
    raise FastARError(f"cannot read {text[start:end]!r}; write KEY[+KEY]*COUNT, e.g. W+D*2 (chunks), W*6f "
                      f"(video frames) or W*1.5s (seconds)")


def vocabulary(names) -> re.Pattern:
    """A whole-text pattern that reads only ``names`` (in any case) and exact looks: one C-level pass that
    accepts a text every name of which some world knows (a queue-time check on ComfyUI's event loop)."""
    known = "|".join(re.escape(n) for n in sorted(set(names), key=len, reverse=True))
    name = rf"(?:look\({_NUMBER},{_NUMBER}\)|(?i:{known}))"
    item = rf"{name}(?:\+{name})*(?:\*{_NUMBER}[fcs]?)?"
    return re.compile(rf"{item}(?:,+{item})*")  # over ``compact``'s text


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
    return held_rows(spec, 1, keys, tuple(mouse))[0]


def parse_actions(text: str, spec: ActionSpec, chunk_video_frames: int, fps: float = FPS,
                  first_chunk: int | None = None) -> np.ndarray:
    """Action text, e.g. ``D*4, W+D*2, look_left*6f, zoom_in*1.5s, idle*2``, as actions per video frame
    [N, width]. Each item is keys joined by ``+`` (``spec.keys``, ``idle``, and with a mouse ``look_up``
    / ``look_down`` / ``look_left`` / ``look_right`` or ``look(PITCH,YAW)``), held for a count of chunks
    (``chunk_video_frames`` video frames each), of video frames with ``f``, or of seconds with ``s`` (at
    ``fps``); no count: one chunk. The JSON run-length form ``[["D", 4], ["W+D", 2]]`` (counts in
    chunks) is read too. ``first_chunk``: the video frames a count of chunks holds of the video's first
    chunk where it is shorter (Matrix-Game 2.0's 9: its VAE makes 1 + 4k frames). At most ``MAX_TEXT``
    characters and ``MAX_FRAMES`` video frames."""
    rows, index, ids, counts, total = [], {}, [], [], 0
    for names, count, unit in action_items(text):
        i = index.get(names)
        if i is None:
            i = index[names] = len(rows)
            rows.append(_row(names, spec))
        frames = frame_count(names, count, unit, chunk_video_frames, fps)
        if not total and first_chunk is not None and unit in ("", "c"):
            frames -= chunk_video_frames - first_chunk
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
