"""ComfyUI's frontend in Chromium for the pack's browser tests (Playwright): the page with the pack's
extension loaded, and what they evaluate in it."""
from __future__ import annotations

import os
from pathlib import Path


def chromium() -> str | None:
    """Debian's Chromium, where it is installed."""
    for path in ("/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if Path(path).is_file():
            return path
    return None


def frontend(p, url: str, sync_api, comfyui_path: str):
    """A page with ComfyUI's frontend and the pack's extension loaded (or a skip where the installed frontend
    does not start against this server)."""
    import pytest

    browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox", "--disable-gpu"])
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(url, wait_until="domcontentloaded")
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.wait_for_function("() => window.app && window.app.graph", timeout=60000)
    except sync_api.TimeoutError:
        browser.close()
        if Path(comfyui_path, "server.py").is_file():
            raise
        # The pip-installable ComfyUI wants a newer frontend package than the one installed for
        # the classic checkout; the page then fails before any extension loads (pack or not).
        pytest.skip(f"the installed ComfyUI frontend does not start against this server: {errors[:1]}")
    # the pack's extension registers after the app object exists: a graph loaded before it would get no widget
    page.wait_for_function("() => (window.app.extensions || []).some((e) => e.name === 'FastAR.CacheWidget')",
                           timeout=60000)
    page.keyboard.press("Escape")  # a first-run templates dialog may cover the canvas
    return browser, page


# the whole graph in view: the canvas scaled and moved so every node fits
FIT_GRAPH = """() => { const c = window.app.canvas, ns = window.app.graph._nodes;
    const b = ns.map((n) => n.getBounding());
    const x0 = Math.min(...b.map((r) => r[0])), y0 = Math.min(...b.map((r) => r[1]));
    const x1 = Math.max(...b.map((r) => r[0] + r[2])), y1 = Math.max(...b.map((r) => r[1] + r[3]));
    const el = c.canvas, s = 0.95 * Math.min(el.width / (x1 - x0), el.height / (y1 - y0));
    c.ds.scale = s;
    c.ds.offset = [-x0 + (el.width / s - (x1 - x0)) / 2, -y0 + (el.height / s - (y1 - y0)) / 2];
    c.setDirty(true, true); }"""
CLOSE_DIALOGS = """() => document.querySelectorAll('.p-dialog-close-button, .p-dialog [aria-label=Close]')
                             .forEach((b) => b.click())"""


def screenshot(page, name):
    """Where FASTAR_SCREENSHOTS names a folder (docs/ for the README), the page as ``name``."""
    folder = os.environ.get("FASTAR_SCREENSHOTS")
    if folder:
        page.screenshot(path=str(Path(folder) / name))
