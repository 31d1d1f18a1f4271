"""Names in the slot folder that point elsewhere: llama-server saves and restores through them.

llama-server reads and writes slot files only by a name in its ``--slot-save-path``; a
symbolic link by such a name lets it write into or read from another folder (the hot copies
in memory, ``chunks.hot``). A link found where a whole file must stay (a save kept whole, a
crash mid-save) is replaced by a copy of what it points to (``materialize``).
"""
from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path


def point(link: Path, target: Path) -> None:
    """Make ``link`` a symbolic link to ``target`` (whatever was at ``link`` is replaced)."""
    link.unlink(missing_ok=True)
    os.symlink(target, link)


def materialize(link: Path) -> str | None:
    """Make ``link``, a slot folder's link to a hot file, a whole file of its own (a file kept
    whole, or found after a crash, must outlive the memory it was written to); what was done,
    or None when ``link`` is no link. A link whose file is gone (a reboot) is deleted."""
    if not link.is_symlink():
        return None
    copy = link.with_name(f".{link.name}.{secrets.token_hex(4)}.tmp")   # a leftover to the sweep
    try:
        shutil.copyfile(link, copy)
    except FileNotFoundError:
        copy.unlink(missing_ok=True)
        link.unlink(missing_ok=True)
        return f"deleted {link.name}: the hot file it pointed to is gone"
    except OSError:
        copy.unlink(missing_ok=True)
        raise
    os.replace(copy, link)
    return f"copied the hot file {link.name} pointed to into the slot folder"
