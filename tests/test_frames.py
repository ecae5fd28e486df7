"""Wan's frame arithmetic (``fastar.frames``) against a video laid out frame by frame, and the settings
that cannot run together (``fastar.check_settings``, and the nodes' words for them)."""
from __future__ import annotations

import pytest

from comfyui_fastar.fastar import (AnnConfig, CacheConfig, FastARError, ShortHistory, TempCacheConfig, UnsortableCache,
                                   check_settings)
from comfyui_fastar.fastar import frames as F


def _latent_of_frames(latents: int) -> list[int]:
    """The latent frame each video frame of ``latents`` latent frames comes from: 1 video frame for the
    first, 4 for every later one."""
    return [l for l in range(latents) for _ in range(1 if l == 0 else 4)]


def test_frame_counts_follow_wans_vae():
    for n in range(0, 40):
        assert F.video_frames(n) == len(_latent_of_frames(n))
        assert F.latent_frames(F.video_frames(n)) == n
    lengths = {len(_latent_of_frames(n)) for n in range(1, 40)}
    assert [v for v in range(1, 150) if F.is_video_length(v)] == sorted(v for v in lengths if v < 150)
    assert not F.is_video_length(0)
    for v in range(1, 150):
        lo, hi = F.nearest_video_lengths(v)
        assert F.is_video_length(lo) and F.is_video_length(hi) and lo <= v < hi and hi - lo == 4
    assert F.nearest_video_lengths(22) == (21, 25) and F.nearest_video_lengths(21) == (21, 25)


def test_frame_positions_of_latents_and_chunks():
    of = _latent_of_frames(30)
    for latent in range(30):
        assert F.first_video_frame(latent) == of.index(latent)
    for v in range(0, len(of)):
        assert F.first_latent_from(v) == min(l for l in range(31) if l == 30 or of.index(l) >= v)
    for chunk_frames in (1, 3):
        for c in range(30 // chunk_frames):
            assert F.chunk_first_frame(c, chunk_frames) == of.index(c * chunk_frames)
            if c:
                last = F.chunk_first_frame(c + 1, chunk_frames) if (c + 1) * chunk_frames < 30 else len(of)
                assert last - F.chunk_first_frame(c, chunk_frames) == F.chunk_video_frames(chunk_frames)
        for first in (0, 1):  # chunks after a start image's latent frame
            for v in range(1, len(of) - 12):
                chunk = F.first_chunk_from(v, chunk_frames, first)
                assert F.chunk_first_frame(chunk, chunk_frames, first) >= v  # every frame of it at or after v
                assert chunk == 0 or F.chunk_first_frame(chunk - 1, chunk_frames, first) < v  # the first such
            assert F.chunk_first_frame(0, chunk_frames, first) == of.index(first)


def test_whole_chunks_and_the_lengths_that_fit_them():
    assert [F.whole_chunks(n, 3) for n in range(0, 8)] == [0, 1, 1, 1, 2, 2, 2, 3]
    assert F.chunked_lengths(5, 3) == [F.video_frames(3), F.video_frames(6)] == [9, 21]
    assert F.chunked_lengths(2, 3) == [F.video_frames(3)]  # no chunk below 3 frames
    assert F.chunked_lengths(7, 1) == [25, 29]
    assert F.chunked_lengths(6, 3, first=1) == [F.video_frames(4), F.video_frames(7)] == [13, 25]  # a start image's


def test_settings_that_cannot_run_together():
    window = CacheConfig("window", 3, 12)
    assert not window.sortable and CacheConfig().sortable and TempCacheConfig().sortable
    with pytest.raises(UnsortableCache, match="^AnnConfig.annsa reads a bucket-sorted history"):
        check_settings(window, AnnConfig(), 3)
    check_settings(window, AnnConfig(annsa=False), 3)
    check_settings(window, None, 3)
    check_settings(CacheConfig(), AnnConfig(), 3)
    short = TempCacheConfig(max_cache_frames=5, sink_frames=3)
    check_settings(short, AnnConfig(), 2)
    with pytest.raises(ShortHistory, match=r"^TempCacheConfig.max_cache_frames 5 leaves 2 frames of history beside 3 "
                                           r"frames of sink, less than one chunk of 3 frames; set "
                                           r"TempCacheConfig.max_cache_frames to at least 6 or "
                                           r"TempCacheConfig.sink_frames to at most 2$"):
        check_settings(short, AnnConfig(), 3)
    assert issubclass(UnsortableCache, FastARError) and issubclass(ShortHistory, FastARError)


def test_the_nodes_settings_name_conflicts_as_the_graph_shows_them():
    from comfyui_fastar.nodes.settings import SETTINGS_KEY, FastARSettings, settings_of

    assert FastARSettings() == FastARSettings(TempCacheConfig(), None, False)  # the library's TempCache defaults
    with pytest.raises(FastARError, match=r"^Some Node: ANN Sparsity's annsa reads a bucket-sorted history, which "
                                          r"a window cache does not keep"):
        FastARSettings(CacheConfig("window"), AnnConfig()).check(1, "Some Node")
    with pytest.raises(FastARError, match=r"^Some Node: TempCache Settings' max_cache_frames 5 leaves 2 frames of "
                                          r"history beside 3 frames of sink, less than one chunk of 3 frames; set "
                                          r"TempCache Settings' max_cache_frames to at least 6 or TempCache Settings' "
                                          r"sink_frames to at most 2$"):
        FastARSettings(TempCacheConfig(max_cache_frames=5)).check(3, "Some Node")
    with pytest.raises(FastARError, match=r"leaves 1 frame of history beside 3 frames of sink, less than one chunk "
                                          r"of 3 frames; set TempCache Settings' max_cache_frames to at least 6 or "
                                          r"TempCache Settings' sink_frames to at most 1$"):
        FastARSettings(TempCacheConfig(max_cache_frames=4)).check(3, "Some Node")
    with pytest.raises(FastARError, match=r"leaves 1 frame of history beside 1 frame of sink, less than one chunk of "
                                          r"3 frames; set TempCache Settings' max_cache_frames to at least 4$"):
        FastARSettings(TempCacheConfig(max_cache_frames=2, sink_frames=1)).check(3, "Some Node")
    with pytest.raises(FastARError, match=r"^TempCache Settings: max_cache_frames 5 leaves 2 frames of history"):
        FastARSettings(TempCacheConfig(max_cache_frames=5)).check(3, "TempCache Settings")  # its own: bare names
    FastARSettings(TempCacheConfig(max_cache_frames=5), AnnConfig()).check(1, "Some Node")

    class Model:
        model_options = {}

    assert settings_of(Model()) == FastARSettings()
    Model.model_options = {SETTINGS_KEY: FastARSettings(fp8_linears=True)}
    assert settings_of(Model()).fp8_linears is True
