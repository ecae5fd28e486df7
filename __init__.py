"""ComfyUI-FastAR: the ComfyUI entry point (V3 extension) and the web extension folder.

Importing this package needs no ComfyUI: the nodes are built only when ComfyUI asks. ComfyUI 0.3.x
takes them from ``NODE_CLASS_MAPPINGS`` (or the V3 ``comfy_entrypoint``); the pip-installable ComfyUI
reads ``NODE_CLASS_MAPPINGS`` first and logs an error where a pack has none, then the entry point.
Both names resolve to the same classes.
"""
WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from comfy_api.latest import ComfyExtension

    from .nodes import node_list

    class FastARExtension(ComfyExtension):
        async def get_node_list(self):
            return node_list()

    return FastARExtension()


def __getattr__(name):
    """``NODE_CLASS_MAPPINGS`` / ``NODE_DISPLAY_NAME_MAPPINGS``, made when ComfyUI reads them, and
    ``FastARError`` (the library's error type, named by this package)."""
    if name == "FastARError":
        from .fastar.errors import FastARError

        return FastARError
    if name in ("NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"):
        if name not in _MAPPINGS:  # made once: ComfyUI reads each name several times while it loads a pack
            from .nodes import node_list

            schemas = [(node, node.define_schema()) for node in node_list()]
            _MAPPINGS["NODE_CLASS_MAPPINGS"] = {schema.node_id: node for node, schema in schemas}
            _MAPPINGS["NODE_DISPLAY_NAME_MAPPINGS"] = {schema.node_id: schema.display_name for _, schema in schemas
                                                       if schema.display_name}
        return _MAPPINGS[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_MAPPINGS: dict = {}


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
