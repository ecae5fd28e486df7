"""ComfyUI node classes: schemas and glue into ``fastar``; no math lives here.

``fastar_nodes`` holds the node classes; ``bridge`` (the samplers) and ``video`` (the streaming decode)
touch ComfyUI internals. None is imported here, so ``import comfyui_fastar.nodes`` works without ComfyUI.
"""


def node_list() -> list:
    """The pack's node classes (imports ComfyUI's API)."""
    from .fastar_nodes import NODES

    return list(NODES)
