"""The TAEHV-family fast decoders against a real ComfyUI: a file at the real key layout (random weights the
test writes) loaded as core's Load VAE loads lighttaew2_1, or by FAST-AR Load Fast Decoder as taew2_1;
streamed chunk by chunk, its frames are core's decode of the whole latent; taew2_1 reads Wan 2.1's
normalized latent; a ComfyUI without TAEHV and files that are not Wan 2.1's decoders are answered in one
line."""
import sys
from types import SimpleNamespace

import pytest
import torch

from comfyui_fastar.testing import comfy_harness

pytestmark = pytest.mark.comfyui
TOL = 1e-5  # relative error, fp32 on the CPU: the same layers, batched over a latent frame's video frames


def _latent(frames, batch=1, h=4, w=6, seed=1):
    return torch.randn(batch, 16, frames, h, w, generator=torch.Generator().manual_seed(seed))


def _streamed(vae, latent, sizes, node="test"):
    from comfyui_fastar.nodes.video import chunk_decoder

    decode, out, first = chunk_decoder(vae, node), [], 0
    for size in sizes:
        out += list(decode(latent[:, :, first:first + size]))
        first += size
    assert first == latent.shape[2]
    return torch.stack(out, 1)  # [B, frames, H, W, 3]


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def light(comfy, tmp_path_factory):
    """lighttaew2_1 (float32: core reads the VAE's latent) as core's Load VAE gives it, and its state dict."""
    path = comfy_harness.taehv_file(tmp_path_factory.mktemp("tae") / "lighttaew2_1.safetensors")
    sd = comfy.utils.load_torch_file(str(path))
    return comfy.sd.VAE(sd=sd), sd


@pytest.mark.taehv
def test_the_file_is_at_cores_layout(light):
    vae, sd = light
    model = vae.first_stage_model
    assert type(model).__name__ == "TAEHV" and model.latent_format is None
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {k: tuple(v.shape) for k, v in sd.items()}


@pytest.mark.taehv
@pytest.mark.parametrize("sizes", [[1] * 7, [1, 3, 3]], ids=["chunks_of_1", "chunks_of_3"])
def test_chunk_by_chunk_frames_are_cores_decode_of_the_whole_latent(light, sizes):
    vae, _ = light
    latent = _latent(7, batch=2)
    whole = vae.decode(latent)  # [B, T, H, W, 3]: core's TAEHV over every frame at once
    streamed = _streamed(vae, latent, sizes)
    assert streamed.shape == whole.shape == (2, 1 + 4 * 6, 32, 48, 3)
    assert whole.std() > 0.05 and (whole[:, 1:] - whole[:, :-1]).abs().mean() > 1e-3  # frames vary in time
    assert _rel(streamed, whole) <= TOL


@pytest.mark.taehv
def test_save_video_decodes_with_a_fast_decoder(light):
    from comfyui_fastar.nodes import video

    vae, _ = light
    latent = _latent(3)
    frames = torch.stack(list(video.decoded_frames(vae, latent)))
    assert frames.shape == (9, 32, 48, 3) and _rel(frames, vae.decode(latent)[0]) <= TOL


def _folders(monkeypatch, folder):
    """models/vae_approx is ``folder`` (and models/vae empty), as FAST-AR Load Fast Decoder reads them."""
    from comfyui_fastar.nodes import fast_decoder_nodes

    folder_paths = fast_decoder_nodes.comfy_module("folder_paths")
    monkeypatch.setattr(folder_paths, "get_filename_list", lambda f: sorted(
        p.name for p in folder.iterdir()) if f == "vae_approx" else ["wan_2.1_vae.safetensors"])
    monkeypatch.setattr(folder_paths, "get_full_path", lambda f, name: str(folder / name)
                        if f == "vae_approx" and (folder / name).is_file() else None)


@pytest.mark.taehv
def test_taew2_1_reads_wan_2_1s_normalized_latent(light, comfy, tmp_path, monkeypatch):
    """The same weights as madebyollin's taew2_1 (a float16 file, which core alone reads as HunyuanVideo's):
    its frames of a latent in the VAE's space are lighttaew2_1's of Wan21's normalized latent, in ComfyUI's
    VAE Decode and streamed."""
    import comfy.latent_formats

    from comfyui_fastar.nodes.fast_decoder_nodes import LoadFastDecoder

    comfy_harness.taehv_file(tmp_path / "taew2_1.safetensors", dtype=torch.float16)
    comfy_harness.taehv_file(tmp_path / "lighttaew2_1_fp16.safetensors", dtype=torch.float16)
    _folders(monkeypatch, tmp_path)
    assert LoadFastDecoder.define_schema().inputs[0].options == ["lighttaew2_1_fp16.safetensors",
                                                                 "taew2_1.safetensors"]
    taew = LoadFastDecoder.execute("taew2_1.safetensors").result[0]
    assert comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(tmp_path / "taew2_1.safetensors"))
                        ).first_stage_model.latent_format.__name__ == "HunyuanVideo"  # what core alone reads
    raw = LoadFastDecoder.execute("lighttaew2_1_fp16.safetensors").result[0]
    assert raw.first_stage_model.latent_format is None
    latent = _latent(4) * 2 + 0.5  # the VAE's space: not centred, not unit
    wanted = raw.decode(comfy.latent_formats.Wan21().process_in(latent))
    assert wanted.std() > 0.05
    assert _rel(taew.decode(latent), wanted) <= 1e-3  # the weights went through float16 once, both the same
    assert _rel(_streamed(taew, latent, [1, 3]), taew.decode(latent)) <= TOL


@pytest.mark.taehv
def test_the_loader_refuses_what_is_not_a_wan_2_1_fast_decoder(comfy, tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from comfyui_fastar.fastar import FastARError
    from comfyui_fastar.nodes.fast_decoder_nodes import LoadFastDecoder

    comfy_harness.taehv_file(tmp_path / "taehv.safetensors", dtype=torch.float16)
    save_file(comfy_harness.taehv_weights(latent_channels=48), str(tmp_path / "taew2_1_48.safetensors"))
    save_file({"decoder.1.weight": torch.zeros(1)}, str(tmp_path / "taew2_1_broken.safetensors"))
    _folders(monkeypatch, tmp_path)
    with pytest.raises(FastARError, match=r"^FAST-AR Load Fast Decoder: taehv.safetensors: the file's name says "
                                          r"which latent it decodes: taew2_1\* .* taehv is HunyuanVideo's"):
        LoadFastDecoder.execute("taehv.safetensors")
    with pytest.raises(FastARError, match=r"^FAST-AR Load Fast Decoder: taew2_1_broken.safetensors is not a "
                                          r"TAEHV-family decoder"):
        LoadFastDecoder.execute("taew2_1_broken.safetensors")
    with pytest.raises(FastARError, match=r"^FAST-AR Load Fast Decoder: taew2_1_48.safetensors decodes 48-channel "
                                          r"latents, not Wan 2.1's 16"):
        LoadFastDecoder.execute("taew2_1_48.safetensors")
    with pytest.raises(FastARError, match=r"^FAST-AR Load Fast Decoder: .* in neither models/vae_approx nor"):
        LoadFastDecoder.execute("gone.safetensors")
    # Load VAE's Wan 2.2 5B decoder (taew2_2, lighttaew2_2) in a decoding node
    import comfy.taesd.taehv

    from comfyui_fastar.nodes.video import chunk_decoder

    with torch.device("meta"):
        wan22 = SimpleNamespace(first_stage_model=comfy.taesd.taehv.TAEHV(latent_channels=48))
    with pytest.raises(FastARError, match=r"^FAST-AR Video Stream: vae is a fast decoder for 48-channel latents"):
        chunk_decoder(wan22, "FAST-AR Video Stream")


def test_a_comfyui_without_taehv_is_answered_in_one_line(comfy, tmp_path, monkeypatch):
    """v0.3.64 has no comfy/taesd/taehv.py; a tree that has one is made to lack it here."""
    from comfyui_fastar.fastar import FastARError
    from comfyui_fastar.nodes.fast_decoder_nodes import LoadFastDecoder

    monkeypatch.setitem(sys.modules, "comfy.taesd.taehv", None)  # import fails, as where the file is absent
    comfy_harness.taehv_file(tmp_path / "taew2_1.safetensors")
    _folders(monkeypatch, tmp_path)
    with pytest.raises(FastARError) as info:
        LoadFastDecoder.execute("taew2_1.safetensors")
    message = str(info.value)
    assert message.startswith("FAST-AR Load Fast Decoder: this ComfyUI has no TAEHV (comfy/taesd/taehv.py") \
        and "\n" not in message


def test_the_decoding_nodes_refuse_any_other_vae_in_one_line(comfy):
    from comfyui_fastar.fastar import FastARError
    from comfyui_fastar.nodes.video import chunk_decoder

    for node in ("FAST-AR Video Stream", "FAST-AR Save Video", "FAST-AR World Play"):
        with pytest.raises(FastARError, match=f"^{node}: vae is Linear, neither Wan 2.1's VAE nor a TAEHV fast "
                                              f"decoder; load wan_2.1_vae.safetensors with Load VAE"):
            chunk_decoder(SimpleNamespace(first_stage_model=torch.nn.Linear(1, 1)), node)
