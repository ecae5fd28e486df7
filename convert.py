"""``fastar convert`` for a pack that was cloned, not pip-installed: run with ComfyUI's Python,

    python custom_nodes/ComfyUI-FastAR/convert.py self_forcing_dmd.pt models/diffusion_models/self_forcing_dmd.safetensors

to turn a causal Wan 2.1 training checkpoint into the file Load Diffusion Model lists."""
import importlib.util
import sys
from pathlib import Path

if __name__ == "__main__":
    root = Path(__file__).resolve().parent
    spec = importlib.util.spec_from_file_location("comfyui_fastar", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    sys.modules["comfyui_fastar"] = package = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(package)
    from comfyui_fastar.fastar.cli import main

    sys.exit(main(["convert", *sys.argv[1:]], convert_command=f"python {sys.argv[0]}"))
