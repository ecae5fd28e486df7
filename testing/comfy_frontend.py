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


# A stand-in for the Ace editor that the fork's (2026-02's) eval_python extension loads from a CDN at import
# and awaits until it loads: offline the request fails, that await never ends and the frontend never starts.
ACE_STAND_IN = "window.ace = {config: {set() {}}};"


def frontend(p, url: str, sync_api, comfyui_path: str, init_script: str | None = None):
    """A page with ComfyUI's frontend and the pack's extension loaded; ``init_script`` runs first in it and in
    every page it opens (the play page). CDN requests get stand-ins: the tests run offline."""
    browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox", "--disable-gpu"])
    context = browser.new_context(viewport={"width": 1400, "height": 900}, accept_downloads=True)
    context.route("https://cdn.jsdelivr.net/**", lambda route: route.fulfill(
        body=ACE_STAND_IN if route.request.url.endswith("/ace.js") else "", content_type="text/javascript"))
    if init_script:
        context.add_init_script(init_script)
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url, wait_until="domcontentloaded")
    try:
        page.wait_for_function("() => window.app && window.app.graph", timeout=60000)
    except sync_api.TimeoutError:
        browser.close()
        raise AssertionError(f"ComfyUI's frontend ({comfyui_path}) did not start: {errors[:3]}") from None
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
