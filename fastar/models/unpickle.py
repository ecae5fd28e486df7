"""A training checkpoint read with torch's tensors-only unpickler, and, where it refuses a file, what the
file holds (read without running anything in it) and how its owner re-saves the weights as tensors."""
from __future__ import annotations

import os
import re

import torch

from ..errors import FastARError


def read_tensors_only(src: str, name: str, entry: str, then):
    """``torch.load`` of a training checkpoint with the tensors-only unpickler, or one FastARError that
    says what the file holds, that nothing in it ran, and how its owner re-saves the weights as tensors
    (``entry`` of it, then the command ``then(weights_file)``)."""
    import pickle

    try:
        try:
            return torch.load(src, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a legacy (non-zip) file cannot be memory-mapped
            return torch.load(src, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = _objects_in(src, str(exc))
        if not found:  # not a class the unpickler refused: a damaged or foreign file
            raise FastARError(f"{name} is not a torch checkpoint this converter can read ({_first_line(exc)}); "
                              f"nothing was written") from None
        raise FastARError(_refusal(src, name, found, entry, then)) from None
    except Exception as exc:
        raise FastARError(f"{name} is not a torch checkpoint this converter can read ({type(exc).__name__}: "
                          f"{_first_line(exc)}); nothing was written") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


def _objects_in(src: str, message: str) -> list[str]:
    """The classes (``module.Name``) the tensors-only unpickler refuses in ``src``: all of them where
    torch can list them without running anything, else the one its message names."""
    listed = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if listed is not None:
        try:
            found = [g for g in listed(src) if re.fullmatch(r"[\w.]+", g)]
            if found:
                return sorted(found)
        except Exception:  # a legacy file: fall back to the message
            pass
    return sorted(set(re.findall(r"GLOBAL ([\w.]+)", message)))


# modules whose names in a pickle mean calls, not data: a file naming them would run code when loaded
CODE_MODULES = ("builtins", "os", "posix", "nt", "sys", "subprocess", "shutil", "pathlib", "importlib", "runpy",
                "operator", "functools", "codecs", "socket", "webbrowser", "pty", "code", "types", "io", "pickle",
                "marshal", "ctypes", "multiprocessing", "threading", "signal", "inspect", "eval", "exec")


class _Inert:
    """What ``_pickled_entries`` builds for any class or call a pickle names: keeps its arguments, runs nothing."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state

    def __setitem__(self, key, value):  # a dict subclass's items
        pass


def _pickled_entries(src: str) -> dict[str, int | str] | None:
    """A torch zip checkpoint's top-level entries, read without running anything in it: an entry's count
    of tensors, or the class of what it holds; None where the file is not such a checkpoint."""
    import pickle
    import zipfile

    class Dict(dict):  # a state dict: an OrderedDict whose pickle sets its _metadata after its items
        def __setstate__(self, state):
            pass

    class Inert(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in (("collections", "OrderedDict"), ("builtins", "dict")):
                return Dict
            if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
                return _Tensor
            return type(f"{module}.{name}", (_Inert,), {})

        def persistent_load(self, pid):
            return None

    class _Tensor(_Inert):
        pass

    try:
        with zipfile.ZipFile(src) as z:
            data = next(n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
            top = Inert(z.open(data)).load()
    except Exception:
        return None
    if not isinstance(top, dict):
        return None

    def describe(value):
        if isinstance(value, dict):
            return sum(isinstance(v, _Tensor) for v in value.values())
        return type(value).__name__

    return {str(k): describe(v) for k, v in top.items()}


def _refusal(src: str, name: str, found: list[str], entry: str, then) -> str:
    """What a refused checkpoint holds (its entries, where they can be read without running anything) and,
    for data objects (a config, an optimizer's state), the one line of Python that re-saves its weights
    as tensors, run where the checkpoint was made (those classes import there; a class of the training
    script's own, ``__main__.X``, is stood in for by an empty one) and the file is the user's to trust.
    A file naming calls gets no such line."""
    calls = [g for g in found if g.split(".", 1)[0] in CODE_MODULES]
    if calls:
        return (f"{name} carries code: loading it would call {', '.join(calls)}. Nothing in the file ran and "
                f"nothing was written. A model checkpoint needs no such calls; get the weights from the "
                f"checkpoint's authors (a .safetensors file or a plain state dict)")
    entries = _pickled_entries(src) or {}
    weighty = {k: v for k, v in entries.items() if isinstance(v, int) and v > 0}
    if entry not in weighty and weighty:  # the entry that holds the most tensors, not a guess
        entry = max(weighty, key=weighty.get)
    def held(k, v):
        if isinstance(v, int):
            return f"{k} ({v} tensor{'' if v == 1 else 's'})"
        return f"{k} ({'an' if v[:1].lower() in 'aeiou' else 'a'} {v})"

    listed = "; its entries: " + ", ".join(held(k, v) for k, v in entries.items()) if entries else ""
    modules = sorted({g.rsplit(".", 1)[0] for g in found if "." in g and not g.startswith("__main__.")})
    own = [g.split(".", 1)[1] for g in found if g.startswith("__main__.")]
    stand_ins = ("import __main__; " + "; ".join(f"__main__.{n} = type('{n}', (), {{}})" for n in own) + "; "
                 if own else "")
    weights = os.path.splitext(src)[0] + "_weights.pt"
    line = (f"python -c \"import torch{''.join(', ' + m for m in modules)}; {stand_ins}"
            f"torch.serialization.add_safe_globals([{', '.join(found)}]); "
            f"ck = torch.load('{src}', map_location='cpu'); torch.save(ck['{entry}'], '{weights}')\"")
    what = ", ".join(found)
    return (f"{name} holds {'objects' if len(found) > 1 else 'an object'} of {what} beside its tensors{listed}, "
            f"which the converter's tensors-only read does not build: nothing in the file ran and nothing was "
            f"written. If the file is yours or from a source you trust, re-save the model's weights ({entry}) as "
            f"tensors once, with the Python and packages the checkpoint was made with: {line} ; then convert "
            f"that file: {then(weights)}")
