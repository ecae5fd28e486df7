"""The world-model nodes: FAST-AR World Model (the pack's trained world, no download), FAST-AR Action
Schedule (a route a person writes) and FAST-AR World Sampler (the world flown along it under a KV cache),
over ``fastar.actions``, ``fastar.photo_world`` and ``fastar.models.world``."""
from __future__ import annotations

import os
from dataclasses import dataclass

import comfy.model_management
import comfy.utils
import numpy as np
import torch
from comfy_api.latest import io, ui

from ..fastar import FastARError, photo_world
from ..fastar.actions import (FPS, MAX_FRAMES, MAX_TEXT, ActionSpec, action_items, action_names, compact,
                              frame_count, knows, parse_actions, used_names, vocabulary)
from ..fastar.models.world import WORLD_SAMPLING
from .progress import CacheEvents
from .schema import ADVANCED, CacheType, check_widget, node_id, schema
from .words import in_words

WorldType = io.Custom("FASTAR_WORLD")
ActionsType = io.Custom("FASTAR_ACTIONS")
BUNDLED = "world.safetensors (the pack's)"
CHUNK = 12  # video frames a chunk of 3 latent frames makes
# the out-and-back of the pack's demo: away, a loop of 96 frames that takes the first place out of view,
# and the loop's first leg again
DEFAULT_ACTIONS = "A+S*2, D*38f, W*10f, A*38f, S*10f, D*1"
_cache: dict[str, object] = {}
_known = None  # actions.vocabulary of every world's names, made once


def _load(name: str):
    from ..fastar.models import load_wan
    from ..fastar.models.world import WorldModel

    device = comfy.model_management.get_torch_device()
    key = f"{name}@{device}"
    if key not in _cache:
        path = photo_world.WEIGHTS
        model = load_wan(path, device=device, dtype=torch.float32 if device.type == "cpu" else torch.bfloat16)
        if not isinstance(model, WorldModel):
            raise FastARError(f"FAST-AR World Model: {os.path.basename(path)} is not a world model")
        _cache.clear()
        _cache[key] = model
    return _cache[key]


class WorldModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(
            node_id="FastARWorldModel",
            display_name="FAST-AR World Model",
            description="The pack's trained world model (7.5 M parameters, in the pack: no download): keys and the "
                        "mouse move a 64x64 camera over a photograph, and it makes what the camera sees, chunk by "
                        "chunk, remembering through its KV cache what it saw. Runs on a CPU in seconds.",
            inputs=[io.Combo.Input("world", options=[BUNDLED], default=BUNDLED,
                                   tooltip="The world model file (the one the pack ships).")],
            outputs=[WorldType.Output()],
        )

    @classmethod
    def execute(cls, world) -> io.NodeOutput:
        return io.NodeOutput(_load(world))


@dataclass(frozen=True)
class Actions:
    """FAST-AR Action Schedule's output: its text, read by the sampler against its world's keys, and the
    frame rate its seconds count at."""
    text: str
    fps: float = FPS


def _vocabularies() -> dict[str, ActionSpec]:
    """Every world the schedule can drive, by name: the pack's and Matrix-Game 2.0's variants."""
    from ..fastar.models.matrix_game import VARIANTS

    return {"the pack's world": ActionSpec(),
            **{f"Matrix-Game 2.0 {v.name}": v.actions for v in VARIANTS.values()}}


def vocabulary_check(text: str) -> None:
    """Refuses text no world can read: unreadable, or a name no world knows (which keys the loaded world
    has is its sampler's check). Runs at queue time, on ComfyUI's event loop: C-level passes over the text
    only, one where every name is known."""
    global _known
    if _known is None:
        _known = vocabulary(n for spec in _vocabularies().values() for n in action_names(spec))
    if not text.lstrip().startswith("[") and _known.fullmatch(compact(text)):
        return
    specs = _vocabularies().values()
    for name in sorted(used_names(text)):  # an unreadable text is refused here, by its item
        if not any(knows(spec, name) for spec in specs):
            raise FastARError(f"unknown action {name[:40]!r}: no world knows it (the node's description lists "
                              f"each world's keys)")


def timeline(text: str, fps: float, shown: int = 12) -> str:
    """What the schedule holds, for a person: its items in seconds, its length, and which worlds know
    all its keys."""
    vocabulary_check(text)
    names = used_names(text)
    lines, n = [], 0
    for keys, count, unit in action_items(text):
        frames = frame_count(keys, count, unit, CHUNK, fps)
        if len(lines) < shown:
            lines.append(f"{n / fps:6.2f}-{(n + frames) / fps:6.2f} s  {keys}")
        elif len(lines) == shown:
            lines.append("...")
        n += frames
        if n > MAX_FRAMES:
            raise FastARError(f"the actions hold more than {MAX_FRAMES} video frames; at most "
                              f"{MAX_FRAMES} are played")
    lines.append(f"{n} video frames = {-(-n // CHUNK)} chunks of {CHUNK} = {n / fps:.1f} s at {fps:g} fps")
    whole = [name for name, spec in _vocabularies().items() if all(knows(spec, k) for k in names)]
    lines.append("runs on: " + (", ".join(whole) or "no one world: its keys come from different worlds"))
    return "\n".join(lines)


class ActionSchedule(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(
            node_id="FastARActionSchedule",
            display_name="FAST-AR Action Schedule",
            description="What the player does: comma-separated actions, each keys joined by + held for a count "
                        "of chunks (12 video frames each), of video frames with f or of seconds with s. The pack's "
                        "world: W S A D pan, zoom_in, zoom_out, look_up / look_down / look_left / look_right (the "
                        "mouse), idle. Matrix-Game 2.0: its variant's keys (universal W S A D + looks; GTA W S "
                        "drive, A D steer; Temple Run jump, slide, turnleft, turnright, leftside, rightside). "
                        "E.g. 'D*4, W+D*2, look_left*6f, idle*1.5s'; the JSON form [[\"D\", 4], [\"W+D\", 2]] "
                        "works too.",
            inputs=[io.String.Input("actions", multiline=True, default=DEFAULT_ACTIONS,
                                    tooltip="e.g. D*4, W+D*2, look_left*6f, zoom_in*2, idle*1.5s; look(PITCH,YAW) "
                                            "moves the mouse by that much a video frame (within the world's range: "
                                            f"±0.12 the pack's, ±0.1 Matrix-Game 2.0's). At most {MAX_TEXT} "
                                            f"characters and {MAX_FRAMES} video frames."),
                    io.Float.Input("fps", default=FPS, min=1.0, max=120.0, step=1.0, optional=True,
                                   **ADVANCED, tooltip="Video frames a second, for counts in seconds (s).")],
            outputs=[ActionsType.Output()],
        )

    @classmethod
    def validate_inputs(cls, actions):
        try:
            with in_words("FAST-AR Action Schedule"):
                vocabulary_check(actions)
        except FastARError as exc:
            return str(exc)
        return True

    @classmethod
    def execute(cls, actions, fps=FPS) -> io.NodeOutput:
        with in_words("FAST-AR Action Schedule"):
            text = timeline(actions, fps)
        return io.NodeOutput(Actions(actions, float(fps)), ui=ui.PreviewText(text))


def photo_of(image, view: int) -> torch.Tensor:
    """The photograph [3, H, W] in [0, 1]: the IMAGE's first, or the pack's held-out one; at least the
    camera's ``view`` on each side."""
    if image is None:
        return photo_world.load_photo(photo_world.DEMO_PHOTO)
    photo = image[0, ..., :3].permute(2, 0, 1).float().clamp(0, 1).cpu()
    if min(photo.shape[1:]) < view:
        raise FastARError(f"the image is {photo.shape[2]}x{photo.shape[1]} px; the camera's view is {view} px, the "
                          f"image must be at least that on each side")
    return photo


def check_observe(cls, observe: int) -> None:
    """The frames of ground truth shown first: whole chunks, within the widget's range."""
    check_widget(cls, "observe", observe)
    if observe % CHUNK:
        raise FastARError(f"observe {observe} must be a multiple of {CHUNK} video frames")


class WorldSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(
            node_id="FastARWorldSampler",
            display_name="FAST-AR World Sampler",
            description="Flies the world model over a photograph along an Action Schedule: it is shown the first "
                        "observe video frames of the ground truth and makes the rest, 12 video frames a chunk, "
                        "under the KV cache given (TempCache Settings, or Sink + Window Cache). Returns its frames "
                        "and the ground truth (what the camera really sees there), 64x64.",
            inputs=[
                WorldType.Input("world", tooltip="FAST-AR World Model."),
                ActionsType.Input("actions", tooltip="FAST-AR Action Schedule: where the camera goes."),
                CacheType.Input("cache", optional=True,
                                tooltip="TempCache Settings or Sink + Window Cache. Empty: TempCache at its defaults."),
                io.Image.Input("image", optional=True,
                               tooltip="The photograph the world is (at least 64 px a side, and large enough for the "
                                       "route). Empty: a photograph the model never saw in training, in the pack."),
                io.Int.Input("observe", default=36, min=CHUNK, max=1200, step=CHUNK,
                             tooltip="Video frames of ground truth shown first (a multiple of 12): what the world "
                                     "has shown before the model takes over."),
                io.Int.Input("seed", default=0, min=0, max=2 ** 31 - 1, control_after_generate=True,
                             tooltip="The sampling noise. Where the route lies is route_seed's: a new seed "
                                     "samples the same route again."),
                io.Int.Input("route_seed", default=0, min=0, max=2 ** 31 - 1,
                             tooltip="Where on the photograph the route starts: samplers with the same route_seed "
                                     "and actions fly the same route over the same ground truth, whatever their "
                                     "seed."),
            ],
            outputs=[io.Image.Output("frames"), io.Image.Output("ground_truth")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, observe):
        """ComfyUI skips its own min / max for an input read here: checked here too."""
        try:
            with in_words("FAST-AR World Sampler"):
                check_observe(cls, observe)
        except FastARError as exc:
            return str(exc)
        return True

    @classmethod
    def execute(cls, world, actions, observe, seed, route_seed=0, cache=None, image=None) -> io.NodeOutput:
        node = "FAST-AR World Sampler"
        with in_words(node):
            if not hasattr(world, "spec"):
                raise FastARError(f"the world input is {type(world).__name__}, not the pack's world model: a "
                                  f"Matrix-Game 2.0 model runs in FAST-AR Matrix-Game Sampler")
            spec = world.spec
            route = parse_actions(actions.text, spec.actions, CHUNK, actions.fps)
            route = np.concatenate([route, np.zeros((-len(route) % CHUNK, route.shape[1]), np.float32)])
            if observe >= len(route):
                raise FastARError(f"observe {observe} leaves nothing to make: the actions hold {len(route)} video "
                                  f"frames")
            photo = photo_of(image, spec.view).to(next(world.parameters()).device)
            flight = photo_world.flight(photo, route, spec.view, observe, np.random.default_rng(route_seed), None,
                                   spec.actions)
            chunks = (len(route) - observe) // CHUNK
            pbar = comfy.utils.ProgressBar(chunks)
            events = CacheEvents(node_id(cls), video_of=lambda n: n * spec.frames_per_latent)
            events.sampling(WORLD_SAMPLING.frames_per_block, WORLD_SAMPLING.timesteps, WORLD_SAMPLING.shift,
                            "as the pack's world is trained")
            events.start(len(route) // spec.frames_per_latent, chunks)

            def on_chunk(report):
                events(report)
                pbar.update_absolute(report.chunk + 1, chunks)
                comfy.model_management.throw_exception_if_processing_interrupted()

            try:
                with torch.inference_mode():
                    video = photo_world.fly(world, flight, cache=cache, seed=seed, on_chunk=on_chunk)
            except BaseException:
                events.finish("stopped")
                raise
            events.finish("done")
        as_image = lambda v: ((v[0].permute(1, 2, 3, 0) + 1) / 2).clamp(0, 1).float().cpu()  # noqa: E731
        return io.NodeOutput(as_image(video), as_image(flight.truth))
