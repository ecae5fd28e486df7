"""What the pack's node classes share: their category, the pack's own socket types, widget bounds the
nodes check themselves."""
from __future__ import annotations

import inspect

from comfy_api.latest import io

from ..fastar import FastARError

CATEGORY = "FAST-AR"
CacheType = io.Custom("FASTAR_CACHE")
AnnType = io.Custom("FASTAR_ANN")
PromptsType = io.Custom("FASTAR_PROMPTS")
StreamType = io.Custom("FASTAR_VIDEO_STREAM")
StartType = io.Custom("FASTAR_START_IMAGE")
MAX_LENGTH = 100001  # video frames


#: An input's ``advanced`` flag (ComfyUI folds such inputs away, 2026 on; older versions take no such argument
#: and show them all): the tuning inputs whose defaults measurement chose.
ADVANCED = {"advanced": True} if "advanced" in inspect.signature(io.Input.__init__).parameters else {}


def schema(**fields) -> io.Schema:
    return io.Schema(category=CATEGORY, **fields)


def prompts_input(positive: str):
    return PromptsType.Input("prompts", optional=True,
                             tooltip=f"A FAST-AR Prompt Schedule: prompts that take over from {positive} at "
                                     f"the frames it sets (its prompt_1, where connected, replaces {positive}).")


def stream_input():
    return StreamType.Input("stream", optional=True,
                            tooltip="A FAST-AR Video Stream: each chunk is decoded and appended to a video file as "
                                    "it is made, so the video can be watched, and kept after a cancel, while "
                                    "the run goes on.")


def check_widget(node, name: str, value) -> None:
    """ComfyUI's own min / max check of a number input, which it skips for the inputs a node's
    validate_inputs reads (the same bounds, from the node's schema)."""
    spec = next(i for i in node.define_schema().inputs if i.id == name)
    if spec.min is not None and value < spec.min:
        raise FastARError(f"{name} {value} is smaller than its minimum {spec.min}")
    if spec.max is not None and value > spec.max:
        raise FastARError(f"{name} {value} is bigger than its maximum {spec.max}")


def check_pixels(width: int, height: int) -> None:
    """A video's size as the Wan VAE and a 2x2 patch take it: width and height multiples of 16."""
    for name, value in (("width", width), ("height", height)):
        if value % 16:
            raise FastARError(f"{name} {value} is not a multiple of 16 pixels")


def node_id(cls):
    """The running node's id in the graph (ComfyUI's hidden unique_id); None outside a graph."""
    return getattr(getattr(cls, "hidden", None), "unique_id", None)



def graph_prompt(cls):
    """The prompt ComfyUI is running (its hidden PROMPT, for nodes that ask for it); None outside a graph."""
    return getattr(getattr(cls, "hidden", None), "prompt", None)
