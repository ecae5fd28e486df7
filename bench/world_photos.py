"""Build the real-photograph "worlds" a small world model is trained on (assets/worlds).

Sources (photographs only; drawings, renders and abstract wallpapers are left out):

* Debian package ``mate-backgrounds`` (1.26.0-1): the 12 photographs in
  ``usr/share/backgrounds/mate/nature/*.jpg`` (GPL-2+, see assets/LICENSE.md).
  ``desktop/GreenTraditional.jpg`` is a logo graphic, not a photograph, so it is not used;
  ``abstract/Elephants*.jpg`` is a painting, not used either.
* scikit-image's bundled sample data (the copies inside the installed package, no download):
  ``astronaut.png``, ``coffee.png``, ``rocket.jpg`` (public domain / CC0).

``gnome-backgrounds`` 43.1 ships only drawings/renders (webp/svg) and ``sway-backgrounds`` only
logo wallpapers, so neither contributes. opencv-doc images are deliberately not used.

Get the .deb with (any Debian/Ubuntu machine, no root needed)::

    mkdir -p /tmp/pkgs && cd /tmp/pkgs && apt-get download mate-backgrounds

then run::

    python bench/world_photos.py --debs /tmp/pkgs [--out assets/worlds]

Each photo is converted to RGB, resized (Pillow LANCZOS) so its shorter side is 384 px keeping
the aspect ratio, centre-cropped to 768 px along the longer side if it is longer than that, and
saved as JPEG quality 92 (no EXIF/ICC) to ``<out>/train/<name>.jpg`` or ``<out>/heldout/<name>.jpg``.
The split is fixed below (``HELDOUT``).  Needs stdlib, numpy and Pillow (plus scikit-image,
imported only to locate its data folder), and ``dpkg-deb`` on PATH.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
from PIL import Image, ImageOps

SHORT = 384
LONG_MAX = 768
QUALITY = 92

# output name -> path inside the extracted mate-backgrounds package
MATE = {
    "mate_aqua": "usr/share/backgrounds/mate/nature/Aqua.jpg",
    "mate_blinds": "usr/share/backgrounds/mate/nature/Blinds.jpg",
    "mate_dune": "usr/share/backgrounds/mate/nature/Dune.jpg",
    "mate_freshflower": "usr/share/backgrounds/mate/nature/FreshFlower.jpg",
    "mate_garden": "usr/share/backgrounds/mate/nature/Garden.jpg",
    "mate_greenmeadow": "usr/share/backgrounds/mate/nature/GreenMeadow.jpg",
    "mate_ladybird": "usr/share/backgrounds/mate/nature/LadyBird.jpg",
    "mate_raindrops": "usr/share/backgrounds/mate/nature/RainDrops.jpg",
    "mate_storm": "usr/share/backgrounds/mate/nature/Storm.jpg",
    "mate_twowings": "usr/share/backgrounds/mate/nature/TwoWings.jpg",
    "mate_wood": "usr/share/backgrounds/mate/nature/Wood.jpg",
    "mate_yellowflower": "usr/share/backgrounds/mate/nature/YellowFlower.jpg",
}

# output name -> file in skimage/data (bundled in the wheel)
SKIMAGE = {
    "skimage_astronaut": "astronaut.png",
    "skimage_coffee": "coffee.png",
    "skimage_rocket": "rocket.jpg",
}

# Held out for evaluation (fixed, by photograph); everything else is training.
HELDOUT = ("mate_ladybird", "mate_dune", "skimage_coffee")


def prepare(im: Image.Image) -> Image.Image:
    """RGB, shorter side -> SHORT (LANCZOS), centre-crop the longer side to LONG_MAX."""
    im = ImageOps.exif_transpose(im).convert("RGB")
    w, h = im.size
    s = SHORT / min(w, h)
    nw, nh = (SHORT, max(SHORT, round(h * s))) if w <= h else (max(SHORT, round(w * s)), SHORT)
    im = im.resize((nw, nh), Image.LANCZOS)
    if nw > LONG_MAX:
        x0 = (nw - LONG_MAX) // 2
        im = im.crop((x0, 0, x0 + LONG_MAX, nh))
    elif nh > LONG_MAX:
        y0 = (nh - LONG_MAX) // 2
        im = im.crop((0, y0, nw, y0 + LONG_MAX))
    return im


def find_deb(debs: str, pkg: str) -> str:
    hits = sorted(glob.glob(os.path.join(debs, f"{pkg}_*.deb")))
    if not hits:
        sys.exit(f"no {pkg}_*.deb in {debs}; get it with `apt-get download {pkg}`")
    if len(hits) > 1:
        print(f"warning: several {pkg} debs, using {hits[-1]}", file=sys.stderr)
    if "1.26.0-1" not in os.path.basename(hits[-1]):
        print(f"warning: {hits[-1]} is not version 1.26.0-1 (the documented one)", file=sys.stderr)
    return hits[-1]


def skimage_data_dir() -> str:
    import skimage  # only to locate the bundled data folder

    return os.path.join(os.path.dirname(skimage.__file__), "data")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--debs", required=True, help="folder holding mate-backgrounds_*.deb")
    ap.add_argument("--out", default=os.path.join("assets", "worlds"))
    a = ap.parse_args()

    sources: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        deb = find_deb(a.debs, "mate-backgrounds")
        subprocess.run(["dpkg-deb", "-x", deb, tmp], check=True)
        for name, rel in MATE.items():
            sources[name] = os.path.join(tmp, rel)
        sd = skimage_data_dir()
        for name, fn in SKIMAGE.items():
            sources[name] = os.path.join(sd, fn)

        for split in ("train", "heldout"):
            d = os.path.join(a.out, split)
            if os.path.isdir(d):
                shutil.rmtree(d)
            os.makedirs(d)
        total = 0
        for name in sorted(sources):
            split = "heldout" if name in HELDOUT else "train"
            with Image.open(sources[name]) as src:
                im = prepare(src)
            dst = os.path.join(a.out, split, name + ".jpg")
            im.save(dst, "JPEG", quality=QUALITY)
            n = os.path.getsize(dst)
            total += n
            arr = np.asarray(Image.open(dst))
            sha = hashlib.sha256(open(dst, "rb").read()).hexdigest()[:16]
            print(f"{split:8s} {name:20s} {im.size[0]}x{im.size[1]} {n:7d} B "
                  f"mean={arr.mean():6.1f} std={arr.std():5.1f} sha256={sha}")
        print(f"{len(sources)} photos, {total} bytes -> {a.out}")


if __name__ == "__main__":
    main()
