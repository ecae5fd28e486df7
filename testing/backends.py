"""An attention backend the tests force on a machine without FlashAttention-4: its storage (keys with their
bias folded, the query fold) with every call on the torch paths, which read the keys' first D channels."""
from __future__ import annotations

from ..fastar import backend as backends


class FoldedTorch(backends.FlashAttention4):
    """FA4's storage, torch's calls: what a cache keeps where FA4 runs, computed as this machine computes."""

    @staticmethod
    def _runs(q, k) -> bool:
        return False


def fold_forced(monkeypatch) -> None:
    """Every cache made under ``monkeypatch`` keeps FA4's storage (``FoldedTorch``)."""
    monkeypatch.setattr(backends, "_family", lambda device, dtype, head_dim: FoldedTorch)
