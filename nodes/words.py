"""The library's errors in a node's words (importable without ComfyUI, as the node settings are)."""
from __future__ import annotations

import contextlib

from ..fastar import FastARError
from ..fastar.errors import SettingError

#: The node that sets each of the library's settings classes, as the graph shows it.
SETTINGS_NODES = {"TempCacheConfig": "TempCache Settings", "AnnConfig": "ANN Sparsity", "CacheConfig": "Sink + Window Cache"}


def node_message(node: str, exc: FastARError) -> str:
    """The library's message after the node's name, its settings named as the graph shows them: bare on
    the node that sets them, else with their node's name ("TempCache Settings' max_cache_frames")."""
    if not isinstance(exc, SettingError):
        return f"{node}: {exc}"
    return f"{node}: " + exc.named(lambda owner, name: name if SETTINGS_NODES.get(owner, node) == node
                                   else f"{SETTINGS_NODES[owner]}' {name}" if SETTINGS_NODES[owner].endswith("s")
                                   else f"{SETTINGS_NODES[owner]}'s {name}")


@contextlib.contextmanager
def in_words(node: str):
    """A FastARError raised inside, in the node's words (``node_message``)."""
    try:
        yield
    except FastARError as exc:
        raise FastARError(node_message(node, exc)) from None
