"""The cache protocol's bookkeeping: the chunk's rows, ordering, the window's ring and telemetry."""
import pytest
import torch

from comfyui_fastar.fastar import CacheConfig, FastARError, make_cache

TPF = 4


def make(mode="unbounded", max_frames=None, **kw):
    return make_cache(CacheConfig(mode, **kw), num_layers=2, batch=1, num_heads=2, head_dim=8,
                   tokens_per_frame=TPF, chunk_frames=2, max_frames=max_frames)


def chunk(kv, value):
    kv.begin_chunk(kv.frames_cached, 2)
    kv_in = torch.full((1, 2 * TPF, 2, 8), float(value))
    kv.begin_clean_pass()
    for layer in range(2):
        keys, values, bias = kv.attend(layer, kv_in, kv_in + 1)
    kv.commit()
    return keys, values, bias


def test_denoising_forwards_do_not_commit():
    kv = make(max_frames=8)
    chunk(kv, 1.0)
    kv.begin_chunk(2, 2)
    for step in range(3):  # three denoising forwards overwrite the same scratch slots
        keys, _, bias = kv.attend(0, torch.full((1, 8, 2, 8), 10.0 + step), torch.zeros(1, 8, 2, 8))
        assert keys.shape[1] == 4 * TPF and bias is None
        assert (keys[:, :2 * TPF] == 1.0).all() and (keys[:, 2 * TPF:] == 10.0 + step).all()
    assert kv.frames_cached == 2 and kv.stats().tokens_held == 2 * TPF


def test_unbounded_holds_the_rollout_it_was_sized_for():
    kv = make(max_frames=12)
    assert kv.capacity_frames == 12
    for i in range(6):
        chunk(kv, i)
    assert all((kv.k[:, :, 2 * i * TPF:2 * (i + 1) * TPF] == i).all() for i in range(6))
    with pytest.raises(FastARError, match="holds 12 frames"):
        kv.begin_chunk(12, 2)
    with pytest.raises(FastARError, match="max_frames"):
        make()


def test_window_ring_slots():
    kv = make("window", sink_frames=1, window_frames=3)
    for i in range(5):
        chunk(kv, i)  # frames 0..9
    assert kv.capacity_frames == 1 + 3 + 2
    # the sink keeps frame 0 (chunk 0's value); the ring, slot 1 + (frame - 1) % 3, frames 7, 8, 9
    for slot, value in enumerate((0, 3, 4, 4)):
        assert (kv.k[:, :, slot * TPF:(slot + 1) * TPF] == value).all()
    st = kv.stats()
    assert st.tokens_held == 4 * TPF and st.dense_tokens == 10 * TPF and st.frames_cached == 10


def test_a_window_that_skips_frames_holds_what_it_would_have_held():
    """A re-cache of only the frames a window reaches: the sink, a skip, the last frames. Its held rows
    are those of a window given the same K/V for consecutive frames (the cache is blind to positions),
    and the frames after it go on in the ring as in a window that never skipped."""
    skipped, plain = make("window", sink_frames=1, window_frames=3), make("window", sink_frames=1, window_frames=3)
    for kv in (skipped, plain):
        chunk(kv, 0)  # frames 0, 1: the sink and the ring's first
    skipped.skip_to(9)  # 7 frames: not a whole turn of the ring
    assert skipped.frames_cached == 9 and skipped.stats().tokens_held == 2 * TPF  # the skipped frames: not held
    for value in (1, 2):
        chunk(skipped, value)  # frames 9..12
        chunk(plain, value)    # frames 2..5
    assert skipped.stats().frames_cached == 13 and skipped.stats().tokens_held == plain.stats().tokens_held == 4 * TPF
    assert torch.equal(skipped.k, plain.k) and torch.equal(skipped.v, plain.v)
    for kv in (skipped, plain):
        kv.begin_chunk(kv.frames_cached, 2)
    assert skipped.layout == plain.layout


@pytest.mark.parametrize("why, setup, frame, match", [
    ("unbounded", lambda: make(max_frames=8), 4, "unbounded cache holds every frame"),
    ("sink not whole", lambda: make("window", sink_frames=3, window_frames=3), 6, r"holding 0 frames \(sink 3\)"),
    ("backwards", lambda: chunk_of(make("window", sink_frames=1, window_frames=3)), 1, "cannot skip to frame 1"),
])
def test_what_a_cache_cannot_skip(why, setup, frame, match):
    with pytest.raises(FastARError, match=match):
        setup().skip_to(frame)


def chunk_of(kv):
    chunk(kv, 0)
    return kv


def test_protocol_misuse_is_an_error():
    kv = make(max_frames=8)
    with pytest.raises(FastARError, match="begin_chunk first"):
        kv.attend(0, torch.zeros(1, 8, 2, 8), torch.zeros(1, 8, 2, 8))
    with pytest.raises(FastARError, match="in order"):
        kv.begin_chunk(4, 2)
    kv.begin_chunk(0, 2)
    with pytest.raises(FastARError, match=r"chunk K/V must be \[1, 8, 2, 8\]"):
        kv.attend(0, torch.zeros(1, 7, 2, 8), torch.zeros(1, 7, 2, 8))


def test_telemetry_bytes():
    kv = make(max_frames=8)
    chunk(kv, 0.0)
    st = kv.stats()
    assert st.bytes_per_token == 2 * 2 * 1 * 2 * 8 * 4
    assert st.bytes == 2 * (2 * 1 * 8 * TPF * 2 * 8 * 4)  # K and V: a frame cache keeps no key bias
    assert st.held_gb == pytest.approx(2 * TPF * st.bytes_per_token / 1e9)
