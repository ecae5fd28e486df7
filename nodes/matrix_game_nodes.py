"""Matrix-Game 2.0 in ComfyUI: FAST-AR Matrix-Game 2.0 Loader (a released or converted file from
diffusion_models, its variant read off its keys) and FAST-AR Matrix-Game Sampler (a start image, core's
CLIP Vision Encode of it and an Action Schedule, rolled out under FAST-AR's cache), over
``fastar.models.matrix_game``."""
from __future__ import annotations

import logging

import comfy.latent_formats
import comfy.model_management
import comfy.utils
import torch
from comfy_api.latest import io, ui

from ..fastar import FastARError, FlowMatchSchedule
from ..fastar.actions import action_table, parse_actions
from .progress import CacheEvents, comfy_module
from .schema import ADVANCED, CacheType, StartType, check_pixels, check_widget, node_id, schema, stream_input
from .stream import ChunkStream
from .video import start_image_latent
from .world_nodes import CHUNK, ActionsType, WorldType
from .words import in_words

LOADER = "FAST-AR Matrix-Game 2.0 Loader"
SAMPLER = "FAST-AR Matrix-Game Sampler"
WIDTH, HEIGHT = 640, 352  # what Matrix-Game 2.0 is trained at
_loaded: dict[str, object] = {}
folder_paths = comfy_module("folder_paths")


def is_matrix_game(model) -> bool:
    from ..fastar.models.matrix_game import MatrixGameModel

    return isinstance(model, MatrixGameModel)


class MatrixGameLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(
            node_id="FastARMatrixGameLoader",
            display_name=LOADER,
            description="A Matrix-Game 2.0 world model from models/diffusion_models: the released safetensors "
                        "files of Skywork/Matrix-Game-2.0 as they are (or converted by fastar convert --preset "
                        "matrix-game-2). Which of the four it is (universal, GTA driving, Temple Run, the "
                        "foundation model) is read off its weights: its keys, mouse, window and sampling follow.",
            inputs=[io.Combo.Input("model_name", options=folder_paths.get_filename_list("diffusion_models"),
                                   tooltip="e.g. base_distill.safetensors (universal), gta_keyboard2dim.safetensors, "
                                           "templerun_7dim_onlykey.safetensors.")],
            outputs=[WorldType.Output()],
        )

    @classmethod
    def execute(cls, model_name) -> io.NodeOutput:
        from ..fastar.models import load_wan

        device = comfy.model_management.get_torch_device()
        key = f"{model_name}@{device}"
        if key not in _loaded:
            _loaded.clear()  # one world at a time: a second is GBs more
            path = folder_paths.get_full_path_or_raise("diffusion_models", model_name)
            with in_words(LOADER):
                model = load_wan(path, device=device,
                                 dtype=torch.float32 if device.type == "cpu" else torch.bfloat16)
                if not is_matrix_game(model):
                    raise FastARError(f"{model_name} is a {type(model).__name__}, not a Matrix-Game 2.0 model (it has "
                                      f"no action module): Wan 2.1 text-to-video files load with Load Diffusion Model")
            v = model.variant
            logging.info("%s: %s is Matrix-Game 2.0 %s (keys %s%s, window %s latent frames)", LOADER, model_name,
                         v.name, ", ".join(v.keys), " + mouse" if v.mouse else "", v.local_frames or "unbounded")
            _loaded[key] = model
        return io.NodeOutput(_loaded[key])


FIRST_CHUNK = 9  # video frames of the first chunk: Matrix-Game 2.0's VAE makes 1 + 4k (chunk c: [12c - 3, 12c + 9))


def context_tokens(clip_vision_output, model) -> torch.Tensor:
    """CLIP Vision Encode's penultimate tokens [1, 257, 1280] as the model's context, or one clear error."""
    tokens = getattr(clip_vision_output, "penultimate_hidden_states", None)
    if tokens is None:
        raise FastARError("clip_vision_output carries no penultimate tokens: connect core's CLIP Vision Encode")
    if tokens.ndim != 3 or tokens.shape[1:] != (model.context_len, model.context_dim):
        raise FastARError(f"clip_vision_output holds tokens {list(tokens.shape)}; this model reads "
                          f"[1, {model.context_len}, {model.context_dim}]: encode the start image with "
                          f"clip_vision_h.safetensors (ViT-H/14, 224 px) through CLIP Vision Encode, crop none")
    return tokens[:1]


def size_inputs(note: str = "") -> list:
    """The frame size's widgets (advanced): Matrix-Game 2.0 is trained at 640 x 352."""
    return [io.Int.Input(name, default=default, min=16, max=4096, step=16, optional=True, **ADVANCED,
                         tooltip=f"{note}Pixels; Matrix-Game 2.0 is trained at 640 x 352.")
            for name, default in (("width", WIDTH), ("height", HEIGHT))]


def check_size(cls, width: int, height: int) -> None:
    check_widget(cls, "width", width)
    check_widget(cls, "height", height)
    check_pixels(width, height)


def split_rows(rows: torch.Tensor, model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Action rows [N, width] as the model's keyboard [1, N, keys] and mouse [1, N, 2] (None without one),
    on its device."""
    device, keys = next(model.parameters()).device, len(model.variant.keys)
    return rows[None, :, :keys].to(device), rows[None, :, keys:].to(device) if model.variant.mouse else None


def start_latent(start, frames: int, width: int, height: int, node: str) -> torch.Tensor:
    """The start image's condition [1, 20, frames, h, w] (mask and latent): FAST-AR Start Image's image at
    ``width`` x ``height`` through its VAE, in the model's latent space."""
    from ..fastar.models.matrix_game import start_condition

    image = comfy.utils.common_upscale(start.image[:1].movedim(-1, 1), width, height, "bilinear", "center")
    latent = start_image_latent(start.vae, image.movedim(1, -1), frames, node)
    return start_condition(comfy.latent_formats.Wan21().process_in(latent))


class MatrixGameSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(
            node_id="FastARMatrixGameSampler",
            display_name=SAMPLER,
            description="Plays Matrix-Game 2.0 from a start image along an Action Schedule: chunks of 3 latent "
                        "frames (12 video frames; the first 9), each steered by its frames' keys and mouse, under "
                        "FAST-AR's cache (TempCache, or a Sink + Window Cache: the model's own is a window of 6 "
                        "latent frames, 4 for GTA). Decode the LATENT with the Wan VAE, or connect a FAST-AR Video "
                        "Stream to have the video on disk while it is made.",
            inputs=[
                WorldType.Input("world", tooltip=f"{LOADER}."),
                io.ClipVisionOutput.Input("clip_vision_output",
                                          tooltip="CLIP Vision Encode (crop none) of the start image with "
                                                  "clip_vision_h.safetensors: the model's only conditioning besides "
                                                  "the image."),
                StartType.Input("start", tooltip="FAST-AR Start Image: the same image and the Wan 2.1 VAE. The world "
                                                 "starts there."),
                ActionsType.Input("actions", tooltip="FAST-AR Action Schedule with the model's keys: its length is "
                                                     "the video's."),
                CacheType.Input("cache", optional=True,
                                tooltip="TempCache Settings or Sink + Window Cache. Empty: TempCache at its defaults."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                             tooltip="Noise of chunk c is seeded by (seed, c)."),
                io.String.Input("timesteps", default="", optional=True, **ADVANCED,
                                tooltip="Empty: the steps the model's variant is distilled for (1000,666,333 at "
                                        "shift 5; Temple Run 1000,750,500,250). The foundation model has none: "
                                        "give them here."),
                io.Float.Input("shift", default=5.0, min=0.01, max=100.0, step=0.01, optional=True, **ADVANCED,
                               tooltip="Timestep shift, with timesteps given here."),
                *size_inputs(),
                stream_input(),
            ],
            outputs=[io.Latent.Output()],
            hidden=[io.Hidden.unique_id],
            is_output_node=True,  # with a stream its file is the output
        )

    @classmethod
    def validate_inputs(cls, timesteps=""):
        if timesteps and timesteps.strip():
            try:
                FlowMatchSchedule.parse(timesteps)
            except FastARError as exc:
                return f"{SAMPLER}: {exc}"
        return True

    @classmethod
    def execute(cls, world, clip_vision_output, start, actions, seed, cache=None, timesteps="", shift=5.0,
                width=WIDTH, height=HEIGHT, stream=None) -> io.NodeOutput:
        from ..fastar.models.matrix_game import FRAMES_PER_LATENT

        with in_words(SAMPLER):
            if not is_matrix_game(world):
                raise FastARError(f"the world input is {type(world).__name__}, not a Matrix-Game 2.0 model: load one "
                                  f"with {LOADER} (the pack's own world runs in FAST-AR World Sampler)")
            model = world
            check_size(cls, width, height)
            variant = model.variant
            if timesteps and timesteps.strip():
                schedule = FlowMatchSchedule.parse(timesteps, shift=float(shift))
                source = "as the widgets say"
            elif variant.sampling is None:
                raise FastARError(f"the {variant.name} model records no sampling: give its timesteps")
            else:
                schedule, source = variant.sampling.schedule(), f"as Matrix-Game 2.0 {variant.name} is distilled"
            rows = parse_actions(actions.text, variant.actions, CHUNK, actions.fps, first_chunk=FIRST_CHUNK)
            lead = CHUNK - FIRST_CHUNK
            chunks = -(-(len(rows) + lead) // CHUNK)
            rows = torch.from_numpy(action_table(variant.actions, chunks * CHUNK - lead, rows))  # the last held
            frames = 3 * chunks
            context = context_tokens(clip_vision_output, model)
        device = next(model.parameters()).device
        keyboard, mouse = split_rows(rows, model)
        fmt = comfy.latent_formats.Wan21()
        condition = start_latent(start, frames, width, height, SAMPLER).to(device)
        events = CacheEvents(node_id(cls))
        events.sampling(3, schedule.timesteps, schedule.shift, source)
        length = 1 + FRAMES_PER_LATENT * (frames - 1)
        events.start(frames, chunks, length=length)
        pbar = comfy.utils.ProgressBar(chunks)
        chunk_stream, saved = None, []
        out = []

        def on_chunk(report):
            x = fmt.process_out(report.latent.float())
            if chunk_stream is not None:
                chunk_stream(x)
                events.saved(chunk_stream.filenames, chunk_stream.frames_written)
                if not chunk_stream.keep_latent:
                    out.clear()
            out.append(x.cpu())
            events(report)
            pbar.update_absolute(report.chunk + 1, chunks)
            comfy.model_management.throw_exception_if_processing_interrupted()

        try:
            if stream is not None:
                chunk_stream = ChunkStream(stream, width, height, 1, SAMPLER)
            run = model.rollout(context, condition, keyboard, mouse, frames=frames, height=height, width=width,
                                schedule=schedule, cache=cache, seed=int(seed))
            with torch.inference_mode():
                run.run(on_chunk, keep=False)
        except BaseException:
            events.finish("stopped")
            raise
        finally:
            if chunk_stream is not None:
                saved = chunk_stream.close()
        events.finish("done")
        samples = torch.cat(out, 2)
        result = {"samples": samples}
        if not saved:
            return io.NodeOutput(result)
        return io.NodeOutput(result, ui=ui.PreviewVideo([ui.SavedResult(f, sub, io.FolderType.output)
                                                         for f, sub in saved]))
