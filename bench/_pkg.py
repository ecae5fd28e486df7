"""Import the repository as ``comfyui_fastar`` whether or not it is pip-installed (GPU machines)."""
import importlib
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if importlib.util.find_spec("comfyui_fastar") is None:
    spec = importlib.util.spec_from_file_location("comfyui_fastar", os.path.join(ROOT, "__init__.py"),
                                                  submodule_search_locations=[ROOT])
    module = importlib.util.module_from_spec(spec)
    sys.modules["comfyui_fastar"] = module
    spec.loader.exec_module(module)

fastar = importlib.import_module("comfyui_fastar.fastar")
importlib.import_module("comfyui_fastar.fastar.models")
