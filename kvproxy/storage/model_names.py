"""Slot files of an older kvproxy, named without their model, get their model's tag.

Every session and base snapshot file carries the tag of the model that made it
(``<stem>@<tag>.bin``, see ``identity.model_tag``), so models that use one slot
folder, one after the other or behind llama-server's router, never write each
other's files. Files saved before that are renamed at start-up to the name their
sidecar's ``made_by`` gives them, with the companion files llama-server wrote beside
them (``<stem>.bin.ckpt``). The order leaves a complete pair under one name at any
crash: the new sidecar is written, the slot file renamed, then its companions, the old
sidecar removed last; while the old sidecar is there the next start renames again
(what is still under the old name, companions included), and the start-up sweep,
which runs next, deletes a sidecar whose file is gone.
"""
from __future__ import annotations

import os

from kvproxy.sessions.identity import MODEL_SEPARATOR, model_tag, on_model
from kvproxy.storage.store import (SessionStore, migrate_sidecar, move_companions, read_json,
                                   write_json_atomic)


def tag_old_files(store: SessionStore) -> list[str]:
    """Rename every untagged file whose sidecar names its model; one line per file."""
    done: list[str] = []
    renamed: dict[str, tuple[str, str]] = {}
    for path in sorted(store.root.glob("*.json")):
        sidecar = migrate_sidecar(read_json(path))
        if not sidecar or sidecar["stem"] != path.stem or MODEL_SEPARATOR in path.stem:
            continue
        model = model_tag((sidecar.get("made_by") or {}).get("model_path"))
        if not model:
            continue  # never saved: it only counts a session's requests
        old, new = path.stem, on_model(path.stem, model)
        write_json_atomic(store.sidecar_path(new), {**sidecar, "stem": new, "model": model})
        if store.bin_path(old).is_file():
            os.replace(store.bin_path(old), store.bin_path(new))
        move_companions(store.bin_path(old), store.bin_path(new))   # llama-server's <file>.ckpt
        path.unlink(missing_ok=True)
        renamed[old] = (new, model)
        done.append(f"renamed {old}.bin to {new}.bin (the tag of the model that made it)")
    if renamed:
        store.change_table(lambda table: _retag_slots(table, renamed))
    return done


def _retag_slots(table: dict[int, dict], renamed: dict[str, tuple[str, str]]) -> None:
    """Slots that name a renamed file name it by its new name."""
    for entry in table.values():
        if entry.get("active_stem") in renamed:
            entry["active_stem"], entry["model"] = renamed[entry["active_stem"]]
