"""FAST-AR Save Video against a real ComfyUI: the streamed frames are VAE Decode's, the file plays
back with the right frame count, size and rate, a cancel leaves a playable file, bad input is
refused in the node's words. The VAE is Wan 2.1's architecture with random weights the test writes."""
from types import SimpleNamespace

import pytest
import torch

from comfyui_fastar.testing.comfy_harness import read_video

pytestmark = pytest.mark.comfyui


def _latent(frames, batch=1, h=4, w=6, seed=1):
    return torch.randn(batch, 16, frames, h, w, generator=torch.Generator().manual_seed(seed))


def test_streamed_frames_are_vae_decodes(vae):
    from comfyui_fastar.nodes import video

    latent = _latent(5, batch=2)
    stock = vae.decode(latent)  # [B, T, H, W, 3], what VAE Decode returns (before its reshape)
    stock = stock.reshape(-1, *stock.shape[-3:])
    streamed = torch.stack(list(video.decoded_frames(vae, latent)))
    assert streamed.shape == stock.shape == (2 * 17, 32, 48, 3)
    inside = ((stock > 0.01) & (stock < 0.99)).float().mean()
    assert inside > 0.5 and stock.std() > 0.05  # the frames are not clamped flat
    assert ((streamed - stock).norm() / stock.norm()).item() <= 1e-5


@pytest.mark.parametrize("container", ["mp4", "webm"])
def test_the_file_decodes_back_to_the_video(vae, tmp_path, container):
    from comfyui_fastar.nodes import video

    path = tmp_path / f"clip.{container}"
    latent = _latent(4)
    assert video.write_video(str(path), video.decoded_frames(vae, latent), 16.0, container) == 13
    frames, rate, size = read_video(path)
    assert len(frames) == 13 and size == (48, 32) and rate == 16
    stock = vae.decode(latent)[0]
    # lossy codecs: the file is near the decoded frames, not equal
    err = torch.tensor(frames[6] / 255.0) - stock[6].double()
    assert err.abs().mean() < 0.08


def test_a_cancel_leaves_a_shorter_playable_file(vae, tmp_path):
    from comfyui_fastar.nodes import video

    class Cancelled(Exception):
        pass

    def tick(done):
        if done == 3:
            raise Cancelled

    path = tmp_path / "cancelled.mp4"
    with pytest.raises(Cancelled):
        video.write_video(str(path), video.decoded_frames(vae, _latent(6), tick), 16.0, "mp4")
    frames, _, _ = read_video(path)
    assert len(frames) == 1 + 4 + 4  # three latent frames were written whole
    def cancelled_at_once():
        raise Cancelled
        yield

    with pytest.raises(Cancelled):  # cancelled before any frame: no file
        video.write_video(str(tmp_path / "none.mp4"), cancelled_at_once(), 16.0, "mp4")
    assert not (tmp_path / "none.mp4").exists()


def test_the_node_saves_to_the_output_folder_and_refuses_bad_input(vae, tmp_path, monkeypatch):
    from comfyui_fastar.fastar import FastARError
    from comfyui_fastar.nodes import video_nodes

    try:
        import folder_paths
    except ImportError:
        from comfy.cmd import folder_paths
    monkeypatch.setattr(folder_paths, "get_output_directory", lambda: str(tmp_path))
    out = video_nodes.SaveVideo.execute({"samples": _latent(3)}, vae, 16.0, "video/story", "mp4")
    (saved,) = out.ui.as_dict()["images"]
    assert saved["subfolder"] == "video" and saved["type"] == "output" and saved["filename"].endswith(".mp4")
    assert len(read_video(tmp_path / "video" / saved["filename"])[0]) == 9

    with pytest.raises(FastARError, match="^FAST-AR Save Video: vae is Linear, neither Wan 2.1's VAE nor a TAEHV"):
        video_nodes.SaveVideo.execute({"samples": _latent(3)}, SimpleNamespace(first_stage_model=torch.nn.Linear(1, 1)),
                                       16.0, "video/x", "mp4")
    with pytest.raises(FastARError, match=r"samples must be a video latent \[B, C, T, h, w\], got \[1, 16, 4, 4\]"):
        video_nodes.SaveVideo.execute({"samples": torch.zeros(1, 16, 4, 4)}, vae, 16.0, "video/x", "mp4")
    with pytest.raises(FastARError, match=r"must be a Wan video latent \[B, 16, T, h, w\], got \[1, 48, 2, 4, 4\]"):
        video_nodes.SaveVideo.execute({"samples": torch.zeros(1, 48, 2, 4, 4)}, vae, 16.0, "video/x", "mp4")
    assert not list((tmp_path / "video").glob("x_*"))  # nothing written for refused input


def test_cancel_from_the_ui_stops_the_node_and_leaves_a_playable_file(vae, tmp_path, monkeypatch):
    """ComfyUI's interrupt (the Cancel button) between latent frames: the node stops with ComfyUI's
    interrupt exception and the file holds the frames decoded so far."""
    import comfy.model_management
    import comfy.utils

    from comfyui_fastar.nodes import video_nodes

    try:
        import folder_paths
    except ImportError:
        from comfy.cmd import folder_paths
    monkeypatch.setattr(folder_paths, "get_output_directory", lambda: str(tmp_path))
    seen = []

    def update_absolute(self, value, *args, **kwargs):
        seen.append(value)
        if value == 2:
            comfy.model_management.interrupt_current_processing(True)

    monkeypatch.setattr(comfy.utils.ProgressBar, "update_absolute", update_absolute)
    try:
        with pytest.raises(Exception) as info:
            video_nodes.SaveVideo.execute({"samples": _latent(6)}, vae, 16.0, "video/cancel", "mp4")
    finally:
        comfy.model_management.interrupt_current_processing(False)
    assert type(info.value).__name__ == "InterruptProcessingException"  # (its module differs by version)
    assert seen == [1, 2]
    (path,) = (tmp_path / "video").glob("cancel_*.mp4")
    assert len(read_video(path)[0]) == 1 + 4
