"""docs/architecture.md's Layout names every module of kvproxy/, under its own folder, and
names none that no longer exists: the page a newcomer reads first stays true."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY = re.compile(r"^( *)([\w.]+/?) {2,}\S")   # "  slots/   caption", "    plan.py   caption"


def layout_modules() -> set[str]:
    """The ``.py`` files the Layout block lists under ``kvproxy/``, as paths inside it."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = page.split("## Layout", 1)[1].split("\n## ", 1)[0]
    found: set[str] = set()
    folders: list[tuple[int, str]] = []   # (indent, name) of the folders above the line
    inside = False
    for line in block.splitlines():
        if line.startswith("kvproxy/"):
            inside, folders = True, []
            continue
        if inside and line and not line.startswith(" "):
            inside = False   # the next top-level entry (bench/, deploy/, tests/ ...)
        match = ENTRY.match(line) if inside else None
        if not match:
            continue
        indent, name = len(match.group(1)), match.group(2)
        folders = [(i, f) for i, f in folders if i < indent]
        if name.endswith("/"):
            folders.append((indent, name))
        elif name.endswith(".py"):
            found.add("".join(f for _, f in folders) + name)
    return found


def package_modules() -> set[str]:
    package = ROOT / "kvproxy"
    return {str(p.relative_to(package)) for p in package.rglob("*.py")
            if not (p.name == "__init__.py" and p.parent != package)}


def test_the_layout_names_every_module_and_no_other():
    listed, present = layout_modules(), package_modules()
    assert sorted(present - listed) == [], "modules missing from docs/architecture.md's Layout"
    assert sorted(listed - present) == [], "docs/architecture.md names modules that are gone"


def test_the_reader_sees_folders_and_their_files():
    """The parser itself: a file is named with its folder, folders nest by indent."""
    listed = layout_modules()
    assert {"slots/plan.py", "storage/store.py", "telemetry/metrics.py", "ops/metrics.py",
            "__init__.py", "routes.py"} <= listed
