"""PNG plots of a rollout: per-chunk latency and KV-cache size against generated video frames."""
from __future__ import annotations

import os

XLABEL = "video frames generated (1 latent frame = 4 video frames)"


def plot_rollout(series: dict[str, list[dict]], path: str | os.PathLike, title: str) -> None:
    """``series`` maps a label to per-chunk rows with ``video_frames`` (video frames done: what a
    sampler's ``length`` counts), ``latency_ms``, ``cache_gb`` and ``dense_gb``; writes one figure with a
    latency and a memory panel, both against video frames."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for label, rows in series.items():
        frames = [r["video_frames"] for r in rows]
        ax_t.plot(frames, [r["latency_ms"] for r in rows], marker=".", label=label)
        ax_m.plot(frames, [r["cache_gb"] for r in rows], marker=".", label=f"{label}: KV cache held")
    first = next(iter(series.values()))
    ax_m.plot([r["video_frames"] for r in first], [r["dense_gb"] for r in first], "k--", lw=1,
              label="dense unbounded KV")
    ax_t.set(xlabel=XLABEL, ylabel="latency per chunk (ms)", title="chunk latency")
    ax_m.set(xlabel=XLABEL, ylabel="GB", title="KV cache size")
    for ax in (ax_t, ax_m):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
