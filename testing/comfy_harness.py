"""The pack inside a real ComfyUI tree, as the tests (``tests/test_comfy_*.py``) and the benchmarks
(``bench/comfy_bench.py``, ``bench/prompt_switch.py``, ``bench/stream_memory.py``) run it.

``import_comfy`` imports the ComfyUI tree named by ``COMFYUI_PATH`` (or a path given), on the CPU unless
told otherwise, with empty stand-ins for the optional packages ComfyUI imports at module scope for
models and nodes that are never run here (``stand_in_missing``). ``tiny_wan`` and ``write_wan`` make
the smallest Wan 2.1 T2V model ComfyUI's detection builds and write it as ComfyUI's loaders read it,
plain and with core ComfyUI's causal metadata; ``wan_vae_file`` writes a Wan 2.1 VAE with random
weights, ``taehv_file`` a TAEHV-family fast decoder (taew2_1's layout) with random weights, ``clip_vision_h_file`` a ViT-H/14 CLIP vision file with random weights that ComfyUI's CLIP
vision loader takes; ``comfy_server`` runs a ComfyUI server over a base directory, with ``run_prompt``,
``post_json``, ``get_json`` and ``fetch`` to talk to it. The rest are the checks the tests share: a prompt's features, the relative error, the
engine a rollout picks, the frames of a video file.

Importing this module imports nothing but the standard library: a ComfyUI server's ``sitecustomize``
(``sitecustomize``) loads it from its file to install the stand-ins before ComfyUI starts.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import types
from pathlib import Path

# ComfyUI's Wan detection reads the head count as dim // 128, its frequency size as 256 and its text
# width as 4096, so the smallest model it builds has two heads of 128.
TINY = dict(dim=256, ffn_dim=256, num_heads=2, num_layers=2, text_dim=4096, freq_dim=256)
H = W = 32  # pixels: a 4x4 latent, 2x2 tokens a frame
TOKENS = 512  # prompt tokens: Wan's text length, as ComfyUI's umT5 encoder pads them
#: The safetensors metadata that makes core ComfyUI's loader build its causal model (``WAN21_CausalAR``).
CAUSAL_METADATA = {"config": json.dumps({"transformer": {"causal_ar": True}})}
#: Packages ComfyUI imports at module scope for what these runs never call: torchvision (image models;
#: an installed one may not load against this torch build) and PyAV (video files).
OPTIONAL = ("torchvision", "av")


# -- stand-ins for optional packages ---------------------------------------------------------------
class _Unavailable:
    """Anything reached through a stand-in: its attributes resolve, calling it raises."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise ImportError(f"{self._name} cannot be used: its package does not import here")


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an empty package in place of ``name`` and its submodules."""

    def __init__(self, name):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name or fullname.startswith(self.name + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _Unavailable(spec.name).__getattr__
        return module

    def exec_module(self, module):
        pass


def stand_in_missing(names=OPTIONAL) -> list[str]:
    """Each of ``names`` that does not import (absent, or failing against this torch build) is replaced by
    an empty stand-in from then on: ComfyUI's module-scope imports of it succeed, and anything that calls
    into it raises ``ImportError``. Returns the names stood in for."""
    stood_in = []
    for name in names:
        if any(isinstance(f, _StandIn) and f.name == name for f in sys.meta_path):
            continue
        try:
            importlib.import_module(name)
        except Exception:
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[loaded]
            sys.meta_path.insert(0, _StandIn(name))
            stood_in.append(name)
    return stood_in


def sitecustomize() -> str:
    """A ``sitecustomize.py`` that installs ``stand_in_missing`` in a ComfyUI server's process (put its
    folder on the server's ``PYTHONPATH``): it loads this file by its path, so it needs the pack nowhere
    on that process's path."""
    return ("import importlib.util\n"
            f"_spec = importlib.util.spec_from_file_location('fastar_comfy_harness', {str(Path(__file__))!r})\n"
            "_harness = importlib.util.module_from_spec(_spec)\n"
            "_spec.loader.exec_module(_harness)\n"
            "_harness.stand_in_missing()\n")


# -- ComfyUI ---------------------------------------------------------------------------------------
def comfyui_path() -> str | None:
    """The ComfyUI tree ``COMFYUI_PATH`` names, or None where it is unset."""
    return os.environ.get("COMFYUI_PATH") or None


def import_comfy(path: str | None = None, cpu: bool = True):
    """ComfyUI's ``comfy`` package from the tree at ``path`` (default ``COMFYUI_PATH``), with
    ``comfy.model_management`` and ``comfy.sd`` imported; ``cpu``: ComfyUI runs on the CPU (its
    ``--cpu``), as the tests do. Optional packages that do not import get stand-ins first."""
    path = path or comfyui_path()
    if not path:
        raise RuntimeError("no ComfyUI tree: pass its path or set COMFYUI_PATH")
    stand_in_missing()
    if cpu:
        os.environ["COMFYUI_CPU"] = "true"  # (read by the pip-installable ComfyUI's arguments)
    path = os.path.abspath(path)
    if path not in sys.path:
        sys.path.insert(0, path)
    # the pip-installable ComfyUI parses the command line as its own when imported, abbreviations taken: the
    # caller's would become ComfyUI's (a benchmark's --out its output directory, pytest's -c its config file,
    # --cache an error)
    caller, sys.argv[1:] = sys.argv[1:], []
    try:
        import comfy.cli_args

        if cpu:
            comfy.cli_args.args.cpu = True
        import comfy.model_management  # noqa: F401
        import comfy.sd  # noqa: F401
    finally:
        sys.argv[1:] = caller
    return comfy


# -- model files -----------------------------------------------------------------------------------
def tiny_wan(seed: int = 7):
    """The library's Wan 2.1 T2V model at ``TINY``'s sizes, random weights (fp32)."""
    from ..fastar.models import WanConfig, WanModel

    return WanModel(WanConfig(**TINY)).init_random(seed=seed)


def write_wan(model, folder, name: str = "wan", dtype=None) -> tuple[Path, Path]:
    """``model``'s weights as ComfyUI's diffusion-model loaders read them (no fastar metadata), in
    ``folder``: ``name.safetensors``, from which ComfyUI builds its stock Wan model, and
    ``name_causal.safetensors`` with ``CAUSAL_METADATA``. ``dtype``: the weights cast to it (default: as
    they are). Returns the two paths."""
    from safetensors.torch import save_file

    state = {k: (v.detach().to("cpu", dtype) if dtype is not None else v.detach().cpu()).contiguous()
             for k, v in model.state_dict().items()}
    plain, causal = Path(folder, f"{name}.safetensors"), Path(folder, f"{name}_causal.safetensors")
    save_file(state, str(plain))
    save_file(state, str(causal), metadata=CAUSAL_METADATA)
    return plain, causal


def wan_vae_file(path, seed: int = 0, dim: int = 96) -> Path:
    """A Wan 2.1 VAE safetensors file at ``path``: ComfyUI's architecture (``comfy.ldm.wan.vae``, so ComfyUI
    must be imported; base width ``dim``, Wan's own 96 by default), random weights scaled so frames vary."""
    import comfy.ldm.wan.vae
    import torch
    from safetensors.torch import save_file

    with torch.device("meta"):
        model = comfy.ldm.wan.vae.WanVAE(dim=dim, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                         temperal_downsample=[False, True, True])
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in model.state_dict().items():
        if name.endswith("gamma"):  # RMS norm scales
            state[name] = torch.ones(p.shape)
        elif name.endswith("bias"):
            state[name] = torch.zeros(p.shape)
        else:
            fan_in = max(1, p[0].numel())
            state[name] = torch.randn(p.shape, generator=g) / fan_in ** 0.5
    save_file(state, str(path))
    return Path(path)


def taehv_weights(seed: int = 0, latent_channels: int = 16, dtype=None) -> dict:
    """A TAEHV-family state dict (taew2_1, lighttaew2_1: madebyollin's ``TAEHV`` layout, which ComfyUI's
    ``comfy/taesd/taehv.py`` loads) with random weights: written from the layout's table, so it needs no
    ComfyUI; 3x3 convolutions but the 1x1 time pools and grows, scaled by fan-in so the frames vary."""
    import torch

    g = torch.Generator().manual_seed(seed)
    state = {}

    def conv(name, n_in, n_out, k=3, bias=True):
        state[f"{name}.weight"] = torch.randn(n_out, n_in, k, k, generator=g) / (n_in * k * k) ** 0.5
        if bias:
            state[f"{name}.bias"] = 0.1 * torch.randn(n_out, generator=g)

    def stage(part, first, n):
        for i in range(first, first + 3):  # three MemBlocks: conv(2n -> n), ReLU, conv, ReLU, conv
            conv(f"{part}.{i}.conv.0", 2 * n, n)
            conv(f"{part}.{i}.conv.2", n, n)
            conv(f"{part}.{i}.conv.4", n, n)

    # encoder: conv, ReLU, then per stage a TPool (2, 2, 1 frames into one), a stride-2 conv, three MemBlocks
    conv("encoder.0", 3, 64)
    for pool, stride in ((2, 2), (7, 2), (12, 1)):
        conv(f"encoder.{pool}.conv", 64 * stride, 64, k=1, bias=False)
        conv(f"encoder.{pool + 1}", 64, 64, bias=False)
        stage("encoder", pool + 2, 64)
    conv("encoder.17", 64, latent_channels)
    # decoder: Clamp, conv, ReLU, then per stage three MemBlocks, an Upsample, a TGrow (1, 2, 2 frames out of
    # one) and a conv to the next width; ReLU and the conv to RGB
    widths = (256, 128, 64, 64)
    conv("decoder.1", latent_channels, 256)
    for s, (first, stride) in enumerate(((3, 1), (9, 2), (15, 2))):
        stage("decoder", first, widths[s])
        conv(f"decoder.{first + 4}.conv", widths[s], widths[s] * stride, k=1, bias=False)
        conv(f"decoder.{first + 5}", widths[s], widths[s + 1], bias=False)
    conv("decoder.22", 64, 3)
    return {k: v.to(dtype) if dtype is not None else v for k, v in state.items()}


def taehv_file(path, seed: int = 0, dtype=None) -> Path:
    """``taehv_weights`` written as a safetensors file at ``path``."""
    from safetensors.torch import save_file

    save_file(taehv_weights(seed, dtype=dtype), str(path))
    return Path(path)


# -- a ComfyUI server ------------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url):
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def fetch(url):
    """The body at ``url``, or None where the server has none (404)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read()
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def post_json(url, data):
    """(status, JSON body) of a POST of ``data`` as JSON."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(data).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@contextlib.contextmanager
def comfy_server(base: Path, pack: Path):
    """A ComfyUI server of ``COMFYUI_PATH``'s tree on the CPU over the base directory ``base`` (its models/,
    custom_nodes/ as the caller fills them) with the pack at ``pack`` among its custom nodes; yields
    {"url", "port"} once the pack's nodes are listed, and stops it after."""
    import subprocess
    import time

    tree = comfyui_path()
    (base / "custom_nodes").mkdir(exist_ok=True)
    (base / "custom_nodes" / "ComfyUI-FastAR").symlink_to(pack, target_is_directory=True)
    # ComfyUI imports optional packages at module scope; where one cannot load, the server gets a stand-in
    stub = base / "stub"
    stub.mkdir()
    (stub / "sitecustomize.py").write_text(sitecustomize())
    port = free_port()
    paths = [str(stub), os.environ.get("PYTHONPATH", "")]
    common = ["--cpu", "--listen", "127.0.0.1", "--port", str(port), "--disable-auto-launch",
              "--database-url", f"sqlite:///{base / 'comfyui.db'}"]  # not the tree's own user/ folder
    if Path(tree, "server.py").is_file():  # a classic checkout: main.py with a base directory
        cmd = [sys.executable, "main.py", *common, "--base-directory", str(base)]
    else:  # the pip-installable layout: the package's entry point, working directory = base
        paths.insert(1, tree)
        cmd = [sys.executable, "-c", "from comfy.cmd.main import entrypoint; entrypoint()", *common, "--cwd", str(base)]
    # a user's CPU server: the kernels' torch twins, not Triton's interpreter (the kernels have their own tests)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    log = open(base / "server.log", "w")
    proc = subprocess.Popen(cmd, cwd=tree if cmd[1] == "main.py" else str(base), env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                if "FastARPatchModel" in get_json(url + "/object_info/FastARPatchModel"):
                    break
                raise RuntimeError("pack not loaded yet")
            except Exception:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("ComfyUI did not start:\n" + (base / "server.log").read_text()[-4000:])
                time.sleep(0.5)
        yield {"url": url, "port": port}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


async def run_prompt(url, port, graph, timeout=300, on_message=None):
    """Queue ``graph`` and collect the server's messages until it ends; ``on_message`` sees each as it comes,
    while the run goes on. Returns (prompt id, messages)."""
    import aiohttp
    import time
    import uuid

    client_id = uuid.uuid4().hex
    events = []
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"ws://127.0.0.1:{port}/ws?clientId={client_id}") as ws:
            async with session.post(url + "/prompt", json={"prompt": graph, "client_id": client_id}) as r:
                body = await r.json()
                assert r.status == 200, body
            prompt_id = body["prompt_id"]
            deadline = time.time() + timeout
            while time.time() < deadline:
                msg = await ws.receive(timeout=timeout)
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                m = json.loads(msg.data)
                events.append(m)
                if on_message is not None:
                    on_message(m)
                data = m.get("data", {})
                if m["type"] in ("execution_error", "execution_interrupted") and data.get("prompt_id") == prompt_id:
                    break
                if m["type"] == "executing" and data.get("node") is None and data.get("prompt_id") == prompt_id:
                    break
    return prompt_id, events


def clip_vision_h_file(path, seed: int = 0) -> Path:
    """A CLIP vision file ComfyUI's loader reads as ViT-H/14 (clip_vision_h: 632 M parameters, what Wan's
    image-to-video and Matrix-Game 2.0 take) at ``path``: its architecture's every weight, random, stored
    in float8 (632 MB) since only its shapes and ComfyUI's code path matter here."""
    import comfy.clip_model
    import comfy.clip_vision
    import comfy.ops
    import torch
    from safetensors.torch import save_file

    with open(Path(comfy.clip_vision.__file__).with_name("clip_vision_config_h.json")) as f:
        config = json.load(f)
    model = comfy.clip_model.CLIPVisionModelProjection(config, torch.float32, "meta", comfy.ops.manual_cast)
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in model.state_dict().items():
        if "layer_norm" in name or "layrnorm" in name or "layernorm" in name:
            value = torch.ones(p.shape) if name.endswith("weight") else torch.zeros(p.shape)
        else:
            value = torch.randn(p.shape, generator=g) * (0.02 if p.ndim < 2 else p[0].numel() ** -0.5)
        state[name] = value.to(torch.float8_e4m3fn)
    save_file(state, str(path))
    return Path(path)


# -- templates -----------------------------------------------------------------------------------
FILE_INPUTS = {"unet_name", "clip_name", "vae_name", "model_name"}  # model files a user downloads; absent here
FRONTEND_ONLY = {"Note", "MarkdownNote"}  # nodes the frontend keeps out of the prompt


def is_widget(spec) -> bool:
    return isinstance(spec[0], list) or spec[0] in ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")


def api_prompt(workflow: dict, info: dict) -> dict:
    """A UI workflow as an API prompt, checked against /object_info on the way: widget values in
    schema order (seed widgets carry a control value after them), links of matching types, and
    bypassed nodes (mode 4) passing their input of the same type through."""
    nodes = {n["id"]: n for n in workflow["nodes"]}
    links = {l[0]: l for l in workflow["links"]}

    def source(link_id, type_):
        _, origin, slot, _, _, t = links[link_id]
        assert t == type_ or type_ == "*", (t, type_)
        node = nodes[origin]
        if node["mode"] == 4:  # bypassed: the input of the same type flows through
            through = next(i for i in node["inputs"] if i["type"] == type_ and i["link"] is not None)
            return source(through["link"], type_)
        return [str(origin), slot]

    prompt = {}
    for node in workflow["nodes"]:
        if node["mode"] != 0 or node["type"] in FRONTEND_ONLY:
            continue
        assert node["type"] in info, f"{node['type']} is not a node of this ComfyUI"
        schema = info[node["type"]]
        values = list(node["widgets_values"])
        inputs = {}
        for section in ("required", "optional"):
            for name in schema["input_order"].get(section, []):
                spec = schema["input"][section][name]
                slot = next((i for i in node["inputs"] if i["name"] == name), None)
                if is_widget(spec) and slot is None:
                    assert values, f"{node['type']}: no widget value for {name}"
                    value = values.pop(0)
                    options = spec[0] if isinstance(spec[0], list) else spec[1].get("options")
                    if options is not None and name not in FILE_INPUTS:
                        assert value in options, f"{node['type']}.{name}={value!r} not in {options}"
                    inputs[name] = value
                    if spec[1].get("control_after_generate") if len(spec) > 1 else False:
                        assert values.pop(0) in ("fixed", "increment", "decrement", "randomize")
                elif slot is not None and slot["link"] is not None:
                    assert slot["type"] == spec[0], (node["type"], name, slot["type"], spec[0])
                    inputs[name] = source(slot["link"], spec[0])
                else:
                    assert section == "optional", f"{node['type']}: required input {name} is not connected"
        assert not values, f"{node['type']}: {len(values)} widget values left over"
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


# -- checks ----------------------------------------------------------------------------------------
def prompt(seed: int, tokens: int = TOKENS):
    """Seeded Gaussian prompt features [1, tokens, 4096]: a text encoder's output, as CONDITIONING carries it."""
    import torch

    return torch.randn(1, tokens, TINY["text_dim"], generator=torch.Generator().manual_seed(seed))


def rel(a, b) -> float:
    """``|a - b| / |b|`` in fp32, both required finite."""
    import torch

    a, b = a.float(), b.float()
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return ((a - b).norm() / b.norm()).item()


def engine_for(model):
    """The engine a rollout of the ComfyUI ``model`` runs on, as the pack chooses it (``model`` patched
    first where it is not)."""
    from ..nodes import engines, patching

    patched = model if patching.is_patched(model) else patching.patch_model(model)
    options = patching.transformer_options(patched, patched.model_options)
    return engines.choose_engine(patched, options, patched.model_options, "test node")


def read_video(path):
    """A video file's frames (RGB arrays), frame rate and (width, height), through PyAV."""
    import av

    with av.open(str(path)) as f:
        stream = f.streams.video[0]
        frames = [fr.to_ndarray(format="rgb24") for fr in f.decode(stream)]
        return frames, stream.average_rate, (stream.codec_context.width, stream.codec_context.height)
