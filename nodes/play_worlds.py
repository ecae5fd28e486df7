"""The worlds FAST-AR World Play plays, behind one face: the action rows its chunks read (``table``, and
the model's copy written in place before each chunk: ``write_chunk``), where each chunk's rows lie in the
video (``Layout``), its rollout, the frames it shows first and each chunk's decoded frames; and the play
page's key legend, with what each key does in that world."""
from __future__ import annotations

import comfy.latent_formats
import numpy as np
import torch

from ..fastar import FastARError, photo_world
from ..fastar.actions import ActionSpec, action_table, integrate, parse_actions
from .matrix_game_nodes import FIRST_CHUNK, context_tokens, split_rows, start_latent
from .play_routes import NODE
from .video import chunk_decoder
from .world_nodes import CHUNK, photo_of


class Layout:
    """Where a world's chunks lie among the video's frames, which are also its action rows: ``first`` rows
    shown before the first chunk (the pack's world's observed frames), then chunks of ``CHUNK`` video
    frames, the first of them ``lead`` frames short (Matrix-Game 2.0's VAE makes 1 + 4k frames: chunk 0
    is frames [0, 9), chunk c [12c - 3, 12c + 9)). A chunk's action goes into its own rows, as the model's
    own pipeline writes it, so that live rows, a schedule's and the log are the same rows."""
    first = 0
    lead = 0

    def chunk_rows(self, c: int) -> tuple[int, int]:
        return max(self.first, self.first + c * CHUNK - self.lead), self.first + (c + 1) * CHUNK - self.lead

    def rows_played(self, chunks: int) -> int:
        return self.chunk_rows(chunks - 1)[1] if chunks else self.first

    def write_chunk(self, c: int, row: np.ndarray) -> None:
        start, end = self.chunk_rows(c)
        self.write(start, end - start, row)


class PackWorld(Layout):
    """The pack's world over a photograph: the camera starts at its centre and is shown ``observe`` frames
    of the truth there (the log's first rows), then the model makes each chunk."""

    def __init__(self, model, image, observe: int, chunks: int, rows: np.ndarray | None):
        from ..fastar.models.world import WORLD_SAMPLING

        spec = model.spec
        self.spec, self.name, self.size = spec.actions, "the pack's world", (spec.view, spec.view)
        self.words = PACK_WORDS
        photo = photo_of(image, spec.view)
        device = next(model.parameters()).device
        n = observe + chunks * CHUNK
        self.table = action_table(spec.actions, n, rows)
        self.rows = torch.from_numpy(self.table)[None].to(device, model.dtype)  # the context's rows, written live
        centre = torch.tensor([photo.shape[2] / 2, photo.shape[1] / 2, 0.0])
        poses = integrate(torch.from_numpy(self.table[:observe]), spec.actions, centre)
        truth = photo_world.render(photo.to(device), poses.to(device), spec.view).transpose(0, 1)[None]
        self.first = observe
        self.observed = truth
        self.model, self.world = model, spec
        self.sampling = WORLD_SAMPLING
        self.start = spec.encode(truth).to(model.dtype)
        self.context = self.rows.view(1, n // spec.frames_per_latent, -1)

    def reset(self) -> None:
        """Every action after the frames shown first back to idle: the session from its start."""
        self.write(self.first, len(self.table) - self.first, parse_actions("idle", self.spec, 1)[0])

    def rollout(self, cache, seed):
        return self.model.rollout(self.context, self.start, cache=cache, seed=seed)

    def write(self, first: int, count: int, row: np.ndarray) -> None:
        self.table[first:first + count] = row
        self.rows[0, first:first + count] = torch.from_numpy(row).to(self.rows)

    def observed_frames(self) -> torch.Tensor:
        return ((self.observed[0].permute(1, 2, 3, 0) + 1) / 2).float().cpu()

    def decode(self, x0: torch.Tensor):
        """A chunk's frames [n, H, W, 3] in [0, 1], on the CPU, in one piece."""
        yield ((self.world.decode(x0.float())[0].permute(1, 2, 3, 0) + 1) / 2).cpu()


class MatrixGame(Layout):
    """Matrix-Game 2.0 from a start image: chunks of 12 video frames (the first 9, ``lead`` 3),
    decoded by ``vae`` (a fast decoder, or Wan's VAE; None: the start image's)."""
    lead = CHUNK - FIRST_CHUNK

    def __init__(self, model, clip_vision_output, start, chunks: int, rows: np.ndarray | None,
                 size: tuple[int, int], vae=None):
        if clip_vision_output is None or start is None:
            raise FastARError("a Matrix-Game 2.0 world starts from an image: connect clip_vision_output (CLIP Vision "
                              "Encode, crop none) and start (FAST-AR Start Image)")
        variant = model.variant
        if variant.sampling is None:
            raise FastARError(f"the {variant.name} model records no sampling: play a distilled variant")
        self.spec, self.name, self.size = variant.actions, f"Matrix-Game 2.0 {variant.name}", size
        self.words = MATRIX_GAME_WORDS.get(variant.name, {})
        self.model, self.sampling = model, variant.sampling
        self.table = action_table(self.spec, chunks * CHUNK - self.lead, rows)
        self.keyboard, self.mouse = split_rows(torch.from_numpy(self.table).clone(), model)
        frames = 3 * chunks
        device = next(model.parameters()).device
        self.context = context_tokens(clip_vision_output, model)
        self.condition = start_latent(start, frames, size[1], size[0], NODE).to(device)
        self.vae, self.format = start.vae if vae is None else vae, comfy.latent_formats.Wan21()
        self.decoder = chunk_decoder(self.vae, NODE)
        self.frames = frames

    def reset(self) -> None:
        """Every action back to idle, the decoder's cache empty: the session from its start."""
        self.write(0, len(self.table), parse_actions("idle", self.spec, 1)[0])
        self.decoder = chunk_decoder(self.vae, NODE)

    def rollout(self, cache, seed):
        return self.model.rollout(self.context, self.condition, self.keyboard, self.mouse, frames=self.frames,
                                  height=self.size[0], width=self.size[1], schedule=self.sampling.schedule(),
                                  cache=cache, seed=seed)

    def write(self, first: int, count: int, row: np.ndarray) -> None:
        self.table[first:first + count] = row
        keys = len(self.model.variant.keys)
        self.keyboard[0, first:first + count] = torch.from_numpy(row[:keys]).to(self.keyboard)
        if self.mouse is not None:
            self.mouse[0, first:first + count] = torch.from_numpy(row[keys:]).to(self.mouse)

    def observed_frames(self) -> torch.Tensor:
        return torch.zeros(0, *self.size, 3)

    def decode(self, x0: torch.Tensor):
        """A chunk's frames [1, H, W, 3] in [0, 1], on the CPU, each as the decoder makes it."""
        yield from self.decoder(self.format.process_out(x0.float()))


# what each action does, in words, per world (the page's legend): the pack's world pans a camera over a photograph
PACK_WORDS = {"W": "pan up", "S": "pan down", "A": "pan left", "D": "pan right", "zoom_in": "zoom in",
              "zoom_out": "zoom out", "look": "look around (pans the view)"}
WALK = {"W": "walk forward", "S": "walk back", "A": "walk left", "D": "walk right", "look": "look around"}
MATRIX_GAME_WORDS = {
    "universal": WALK, "foundation": WALK,
    "gta": {"forward": "drive forward", "back": "drive back", "look_left": "steer left", "look_right": "steer right",
            "look": "look around"},
    "templerun": {"jump": "jump", "slide": "slide", "turnleft": "turn left", "turnright": "turn right",
                  "leftside": "step left", "rightside": "step right"},
}


def legend(spec: ActionSpec, words: dict[str, str]) -> list[list[str]]:
    """The page's keys: (what to press, the action it sends, what it does in this world's ``words``)."""
    keyboard = {"W": "W", "S": "S", "A": "A", "D": "D", "forward": "W", "back": "S", "jump": "Space",
                "slide": "C", "turnleft": "Q", "turnright": "E", "leftside": "A", "rightside": "D",
                "zoom_in": "Z", "zoom_out": "X"}
    out = [[keyboard.get(k, k), k] for k in spec.keys if k not in spec.idle]
    used = {key for key, _ in out}
    out += [[keyboard[a], target] for a, target in spec.aliases if keyboard.get(a) not in used | {None}]  # GTA's A / D
    if spec.mouse:
        out.append(["mouse", "look"])
    return [[key, action, words.get(action, action)] for key, action in out]
