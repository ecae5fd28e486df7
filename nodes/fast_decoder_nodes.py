"""FAST-AR Load Fast Decoder: a TAEHV-family fast decoder file as ComfyUI's VAE, in the latent space its
makers trained it on. ComfyUI's Load VAE reads which space a 16-channel TAEHV file takes off its dtype (a
float16 file is HunyuanVideo's taehv, a float32 one lighttaew2_1, fed the VAE's latent), and lists neither
madebyollin's taew2_1, which takes the diffusion model's normalized latent. Here the file's name says it:
``taew2_1*`` reads Wan 2.1's normalized latent (``latent_formats.Wan21``'s ``process_in`` of the VAE's),
``lighttaew2_1*`` the VAE's. The VAE then decodes the latents Wan's VAE does, in ComfyUI's VAE Decode and
in the pack's decoding nodes (``video.chunk_decoder``)."""
from __future__ import annotations

import os

import comfy.latent_formats
import comfy.sd
import comfy.utils
from comfy_api.latest import io

from ..fastar import FastARError
from .progress import comfy_module
from .schema import schema
from .video import taehv_module

NODE = "FAST-AR Load Fast Decoder"
FOLDERS = ("vae_approx", "vae")
# file name prefix -> the latent space it decodes: True, Wan 2.1's normalized one; False, the VAE's
SPACES = {"lighttaew2_1": False, "taew2_1": True}


def _files() -> list[str]:
    """The fast decoder files in models/vae_approx and models/vae: names with "tae" in them."""
    folder_paths = comfy_module("folder_paths")
    names = []
    for folder in FOLDERS:
        names += [n for n in folder_paths.get_filename_list(folder) if "tae" in os.path.basename(n).lower()
                  and n not in names]
    return names


def load_fast_decoder(path: str, node: str = NODE):
    """ComfyUI's VAE of the TAEHV-family file at ``path``, reading the latent space its name says (``SPACES``)."""
    taehv_module(node)
    name = os.path.basename(path)
    normalized = next((v for prefix, v in SPACES.items() if name.lower().startswith(prefix)), None)
    if normalized is None:
        raise FastARError(f"{node}: {name}: the file's name says which latent it decodes: taew2_1* (madebyollin's, "
                          f"Wan 2.1's normalized latent) or lighttaew2_1* (the VAE's latent); taehv is "
                          f"HunyuanVideo's, not Wan's")
    sd = comfy.utils.load_torch_file(path)
    if "decoder.22.bias" not in sd:
        raise FastARError(f"{node}: {name} is not a TAEHV-family decoder (it has no decoder.22.bias)")
    if sd["decoder.1.weight"].shape[1] != 16:
        raise FastARError(f"{node}: {name} decodes {sd['decoder.1.weight'].shape[1]}-channel latents, not Wan "
                          f"2.1's 16 (taew2_2 is Wan 2.2 5B's)")
    vae = comfy.sd.VAE(sd=sd)
    model = vae.first_stage_model
    fmt = comfy.latent_formats.Wan21 if normalized else None
    model.latent_format = fmt
    model.process_in = fmt().process_in if normalized else (lambda x: x)
    model.process_out = fmt().process_out if normalized else (lambda x: x)
    return vae


class LoadFastDecoder(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(
            node_id="FastARLoadFastDecoder",
            display_name=NODE,
            description="A fast decoder for Wan 2.1's latents (TAEHV family: a fraction of the Wan VAE's decode "
                        "time and memory, at some loss of detail) from models/vae_approx or models/vae: "
                        "madebyollin's taew2_1 (.pth or .safetensors) or lighttaew2_1, each read in "
                        "the latent space it was trained on. Connect it to FAST-AR Video Stream, Save Video or "
                        "World Play's vae, or to VAE Decode. Needs a ComfyUI with TAEHV (2026 on).",
            inputs=[io.Combo.Input("decoder_name", options=_files(),
                                   tooltip="taew2_1.pth / taew2_1.safetensors (github.com/madebyollin/taehv) or "
                                           "lighttaew2_1.safetensors, in models/vae_approx.")],
            outputs=[io.Vae.Output()],
        )

    @classmethod
    def execute(cls, decoder_name) -> io.NodeOutput:
        folder_paths = comfy_module("folder_paths")
        path = next((p for p in (folder_paths.get_full_path(f, decoder_name) for f in FOLDERS) if p), None)
        if path is None:
            raise FastARError(f"{NODE}: {decoder_name} is in neither models/vae_approx nor models/vae")
        return io.NodeOutput(load_fast_decoder(path))
