"""FAST-AR Video Stream against a real ComfyUI: the Long Sampler's video reaches the file chunk by chunk while
the run goes on (read back between chunks), the file is VAE Decode's video, the sampling is unchanged, a
LATENT of the last chunk only when it is not kept, and a cancel leaves a playable file of the chunks made.
Tiny random Wan model and VAE written by the tests; and the stream benchmark's smoke run."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from comfyui_fastar.testing.comfy_harness import H, W, prompt, read_video

pytestmark = pytest.mark.comfyui

LENGTH = 29  # video frames: 8 latent frames, chunks of 1 (video frames 1, then 4 each)


@pytest.fixture
def output(tmp_path, monkeypatch):
    try:
        import folder_paths
    except ImportError:
        from comfy.cmd import folder_paths
    monkeypatch.setattr(folder_paths, "get_output_directory", lambda: str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def model(comfy, checkpoint):
    from comfyui_fastar.fastar import TempCacheConfig
    from comfyui_fastar.nodes.settings_nodes import PatchModel

    comfy_model = comfy.sd.load_diffusion_model(str(checkpoint), model_options={"dtype": torch.float32})
    return PatchModel.execute(comfy_model, TempCacheConfig(max_cache_frames=4, sink_frames=1)).result[0]


def _sample(model, stream=None, length=LENGTH):
    from comfyui_fastar.nodes.sampler_nodes import AutoregressiveLongSampler

    return AutoregressiveLongSampler.execute(model, [[prompt(1), {}]], W, H, length, 1, 3, "1000,750,500,250", 5.0,
                                             "1", 0.0, 1.0, stream=stream)


def test_the_file_grows_chunk_by_chunk_while_the_run_goes_on(model, vae, output, monkeypatch):
    from comfyui_fastar.nodes import stream as stream_mod
    from comfyui_fastar.nodes import video
    from comfyui_fastar.nodes.video_nodes import VideoStream

    plain = _sample(model).result[0]["samples"]
    seen = []  # frames the file decodes to after each chunk, read while the sampler waits for the next
    real = stream_mod.ChunkStream.__call__

    def call(self, latents):
        real(self, latents)
        self.handoff.drain()  # the chunk is written beside the sampling: read the file once it is
        (path,) = (output / "video").glob("stream_*.mp4")
        seen.append((self.frames_written, read_video(path)[0]))

    monkeypatch.setattr(stream_mod.ChunkStream, "__call__", call)
    written = []
    real_write = video.VideoWriter.write
    monkeypatch.setattr(video.VideoWriter, "write", lambda self, frame: (written.append(frame), real_write(self, frame)))
    stream = VideoStream.execute(vae, 16.0, "video/stream", True).result[0]
    out = _sample(model, stream)
    latent = out.result[0]["samples"]
    assert torch.equal(latent, plain)  # the stream changes no sample
    (saved,) = out.ui.as_dict()["images"]
    assert saved["filename"].startswith("stream_") and saved["type"] == "output"
    final, rate, size = read_video(output / "video" / saved["filename"])
    assert len(final) == LENGTH and rate == 16 and size == (W, H)
    # after each chunk: every frame made but the newest (its fragment follows with the next frame), each the
    # final file's own
    assert [n for n, _ in seen] == [1 + 4 * c for c in range(8)]
    assert [len(frames) for _, frames in seen] == [4 * c for c in range(8)]
    for _, frames in seen:
        assert all((a == b).all() for a, b in zip(frames, final))
    # the frames written are VAE Decode's video of the LATENT, decoded chunk by chunk; the file holds them
    # through a lossy codec (near, not equal)
    with torch.inference_mode():  # the LATENT was made in it, as ComfyUI's executor runs nodes
        stock = vae.decode(latent)[0]
    written = torch.stack(written)
    assert written.shape == stock.shape and stock.std() > 0.05
    assert ((written - stock).norm() / stock.norm()).item() <= 1e-5
    err = torch.stack([torch.tensor(f / 255.0) for f in final]) - written.double()
    assert err.abs().mean() < 0.1


@pytest.mark.taehv
def test_a_fast_decoder_streams_cores_frames_of_the_whole_latent(model, comfy, output, tmp_path, monkeypatch):
    """lighttaew2_1 (random weights at its real layout) as core's Load VAE gives it: the frames written,
    chunk by chunk while the run goes on, are core's decode of the whole LATENT with it."""
    from comfyui_fastar.nodes import video
    from comfyui_fastar.nodes.video_nodes import VideoStream
    from comfyui_fastar.testing.comfy_harness import taehv_file

    path = taehv_file(tmp_path / "lighttaew2_1.safetensors")
    fast = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(path)))
    written = []
    real_write = video.VideoWriter.write
    monkeypatch.setattr(video.VideoWriter, "write", lambda self, frame: (written.append(frame), real_write(self, frame)))
    out = _sample(model, VideoStream.execute(fast, 16.0, "video/fast", True).result[0])
    with torch.inference_mode():
        stock = fast.decode(out.result[0]["samples"])[0]
    written = torch.stack(written)
    assert written.shape == stock.shape == (LENGTH, H, W, 3) and stock.std() > 0.05
    assert ((written - stock).norm() / stock.norm()).item() <= 1e-5
    (saved,) = out.ui.as_dict()["images"]
    assert len(read_video(output / "video" / saved["filename"])[0]) == LENGTH


def test_without_the_latent_kept_the_output_is_the_last_chunk_and_the_file_whole(model, vae, output):
    from comfyui_fastar.nodes.video_nodes import VideoStream

    plain = _sample(model, length=25).result[0]["samples"]  # 7 latent frames
    stream = VideoStream.execute(vae, 16.0, "video/flat", False).result[0]
    out = _sample(model, stream, length=25)
    assert torch.equal(out.result[0]["samples"], plain[:, :, -1:])
    (saved,) = out.ui.as_dict()["images"]
    assert len(read_video(output / "video" / saved["filename"])[0]) == 25


def test_a_cancel_keeps_a_playable_file_of_the_chunks_made(model, vae, output, monkeypatch):
    """A Cancel taken by the writer's decode beside the sampling (ComfyUI's ops take it in any thread) in
    the third chunk: the run stops as cancelled, and the file plays every chunk the sampling made, each
    frame VAE Decode's of the uncancelled run (the decode redone from the decoder's memory before it)."""
    import threading

    import comfy.model_management

    from comfyui_fastar.nodes import stream as stream_mod
    from comfyui_fastar.nodes import video
    from comfyui_fastar.nodes.video_nodes import VideoStream

    plain = _sample(model).result[0]["samples"]
    with torch.inference_mode():
        stock = vae.decode(plain)[0]
    written, handed, taken = [], [0], []
    real_write = video.VideoWriter.write
    monkeypatch.setattr(video.VideoWriter, "write", lambda self, frame: (written.append(frame), real_write(self, frame)))
    real_call = stream_mod.ChunkStream.__call__
    monkeypatch.setattr(stream_mod.ChunkStream, "__call__",
                        lambda self, latents: (handed.__setitem__(0, handed[0] + 1), real_call(self, latents)))
    try:
        from comfy.interruption import _interrupt_processing_mutex as mutex
    except ImportError:  # ComfyUI before 2026
        mutex = comfy.model_management.interrupt_processing_mutex
    real_frames = video.WanChunks._frames
    calls = [0]

    def frames(self, z):
        calls[0] += 1
        if calls[0] == 3:  # the third latent frame's decode, on the writer's thread: an op takes the Cancel
            with mutex:  # pressed and taken here, before the sampling thread's ops can take it
                comfy.model_management.interrupt_current_processing(True)
                taken.append(threading.current_thread().name)
                comfy.model_management.throw_exception_if_processing_interrupted()
        return real_frames(self, z)

    monkeypatch.setattr(video.WanChunks, "_frames", frames)
    stream = VideoStream.execute(vae, 16.0, "video/cancel", True).result[0]
    try:
        with pytest.raises(Exception) as info:
            _sample(model, stream)
    finally:
        comfy.model_management.interrupt_current_processing(False)
    assert type(info.value).__name__ == "InterruptProcessingException"
    assert taken == ["fastar-video-stream"]
    chunks = handed[0]  # one latent frame each: video frames 1, then 4 each
    assert 3 <= chunks < 8
    (path,) = (output / "video").glob("cancel_*.mp4")
    assert len(read_video(path)[0]) == len(written) == 1 + 4 * (chunks - 1)
    written = torch.stack(written)
    assert ((written - stock[:len(written)]).norm() / stock[:len(written)].norm()).item() <= 1e-5


def test_the_stream_refuses_a_vae_it_cannot_decode_with(comfy):
    from comfyui_fastar.fastar import FastARError
    from comfyui_fastar.nodes.video_nodes import VideoStream

    class NotWan:
        first_stage_model = torch.nn.Linear(1, 1)

    with pytest.raises(FastARError, match="^FAST-AR Video Stream: vae is Linear, neither Wan 2.1's VAE nor a TAEHV"):
        VideoStream.execute(NotWan(), 16.0, "video/x", True)


@pytest.mark.slow
@pytest.mark.taehv
def test_the_stream_benchmark_times_each_decoder_and_loop(comfy, tmp_path):
    """bench/stream_bench.py --smoke: the Long Sampler into a Video Stream, serial and pipelined, every file
    the whole video, and the result names the shapes, the loops and their ratio."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import stream_bench

    result = stream_bench.main(["--comfyui", os.environ["COMFYUI_PATH"], "--smoke", "--decoders", "taehv",
                                "--out", str(tmp_path)])
    assert json.loads((tmp_path / "stream_bench_smoke.json").read_text())["summary"] == result["summary"]
    assert set(result["summary"]) == {"taehv/serial", "taehv/pipelined"}
    assert all(row["frames"] == result["shape"]["video_frames"] == 45 and row["fps"] > 0 and row["chunk_ms"] > 0
               for row in result["summary"].values())
    ratio = result["summary"]["taehv/pipelined"]["fps"] / result["summary"]["taehv/serial"]["fps"]
    assert result["ratios"] == {"taehv pipelined / serial": ratio}
