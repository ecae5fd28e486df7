"""The one error type the library raises for bad input; its message names the problem."""


class FastARError(ValueError):
    pass


# ComfyUI shows an error's type by its module path; inside ComfyUI the pack's folder is the package name
# (e.g. "ComfyUI-FastAR.fastar.errors"), so the type is named by the installed package, which exports it.
FastARError.__module__ = "comfyui_fastar"
