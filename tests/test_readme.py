"""The README's first-run commands, pasted as a user pastes them: the main job after the install, and the
flight over one's own photograph. (The install itself is what CI does before running this; the clone
needs the network, and the converter's commands need a checkpoint: tests of their own cover those.)"""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _bash_lines() -> list[str]:
    readme = (REPO / "README.md").read_text()
    return [line for block in re.findall(r"```bash\n(.*?)```", readme, re.S) for line in block.splitlines() if line]


def _fastar_commands() -> list[str]:
    """Each README line that runs ``fastar`` (the part after an install's ``&&``), the converter excepted."""
    commands = []
    for line in _bash_lines():
        command = line.split("&&")[-1].strip()
        if command.split()[0] == "fastar" and command.split()[1:2] != ["convert"]:
            commands.append(command)
    return commands


def _run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """``command`` as a shell runs it: ``fastar`` is the installed script, or this Python's module where no
    script is on PATH (a checkout used without its install)."""
    fastar = shutil.which("fastar") or f"{shlex.quote(sys.executable)} -m comfyui_fastar.fastar"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a user's CPU: the twins
    return subprocess.run(fastar + command[len("fastar"):], shell=True, cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_readme_names_its_first_runs():
    assert _fastar_commands() == ["fastar", 'fastar --world my_photo.jpg --actions "D*4, W+D*2, look_left*6f, '
                                            'zoom_in*2, idle"']


@pytest.mark.slow
def test_the_readmes_first_runs_run_as_pasted(tmp_path):
    from comfyui_fastar.fastar import photo_world

    shutil.copy(os.path.join(photo_world.PHOTOS, "heldout", "mate_ladybird.jpg"), tmp_path / "my_photo.jpg")
    for command in _fastar_commands():
        run = _run(command, tmp_path)
        assert run.returncode == 0, (command, run.stderr[-2000:])
        summary = json.loads((tmp_path / "fastar_world" / "world.json").read_text())
        assert set(summary["caches"]) == {"window (sink 3 + 12)", "TempCache 12"}
        assert summary["world"] == ("my_photo.jpg" if "--world" in command else os.path.basename(photo_world.DEMO_PHOTO))
        assert (tmp_path / "fastar_world" / "world.gif").stat().st_size > 0


def test_the_readme_is_a_page_a_user_reads_and_its_pictures_exist():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    pictures = re.findall(r"\]\(((?:docs|bench)/[^)\s]+\.(?:png|jpg|gif))\)", readme)
    assert "docs/world_template_result.png" in pictures and "docs/sampling_from_file.png" in pictures
    assert [p for p in pictures if not (REPO / p).is_file()] == []


def test_the_readme_lists_every_template_by_its_file_name():
    """Each template is listed by the name ComfyUI shows, its file's stem, and the count in words is right."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("**Templates.**", 1)[1].split("**Model files.**", 1)[0]
    listed = set(re.findall(r"^- \*\*(FAST-AR - [^*]+)\*\*", section, re.M))
    stems = {p.stem for p in (REPO / "example_workflows").glob("*.json")}
    assert listed == stems, listed ^ stems
    words = {9: "nine", 10: "ten", 11: "eleven", 12: "twelve", 13: "thirteen"}
    assert f"lists {words[len(stems)]} workflows" in section
