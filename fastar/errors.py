"""The errors the library raises for bad input; each message names the problem."""
from __future__ import annotations

import re
from typing import Callable


class FastARError(ValueError):
    pass


_SETTING = re.compile(r"\{([A-Za-z]\w*)\.(\w+)\}")


class SettingError(FastARError):
    """A bad setting, or settings that cannot run together. The message is written once, naming each
    setting as ``{Config.field}`` (``{TempCacheConfig.max_cache_frames}``); ``str()`` names them so
    (``TempCacheConfig.max_cache_frames``), and a front door names them as its user sees them
    (``named``: the nodes' "TempCache Settings' max_cache_frames")."""

    def __init__(self, template: str):
        self.template = template
        self.settings = tuple(_SETTING.findall(template))  # (config class, field) pairs, in order
        super().__init__(self.named(lambda owner, name: f"{owner}.{name}"))

    def named(self, name: Callable[[str, str], str]) -> str:
        """The message with every ``{Config.field}`` as ``name(config class, field)``."""
        return _SETTING.sub(lambda m: name(m[1], m[2]), self.template)


class UnsortableCache(SettingError):
    """AnnSA over a cache whose history it cannot bucket-sort."""


class ShortHistory(SettingError):
    """A TempCache whose history holds less than one chunk."""


# ComfyUI shows an error's type by its module path; inside ComfyUI the pack's folder is the package name
# (e.g. "ComfyUI-FastAR.fastar.errors"), so the type is named by the installed package, which exports it.
FastARError.__module__ = "comfyui_fastar"
