"""ComfyUI-FastAR: the ComfyUI entry point (V3 extension) and the web extension folder.

Importing this package needs no ComfyUI: the extension is built only when ComfyUI asks.
"""
WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from comfy_api.latest import ComfyExtension

    from .nodes import node_list

    class FastARExtension(ComfyExtension):
        async def get_node_list(self):
            return node_list()

    return FastARExtension()


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
