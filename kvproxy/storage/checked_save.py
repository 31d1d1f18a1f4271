"""A checked save: llama-server's file under a temporary name, its size checked, then put in place.

llama-server overwrites a slot file in place and reports what it wrote, without
fsync; a full disk can leave a short file behind a success answer. So a save
goes to a temporary name first, its size on disk is compared with
llama-server's count, and only then is it renamed over the session's file, with
its companions (``<stem>.bin.ckpt``, see ``store.companions``) after the file and
before the sidecar that records them. The call that has llama-server write the
file is the caller's (``write``): this module only checks and installs files.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

from kvproxy.errors import UpstreamError
from kvproxy.storage.store import (TEMP_SUFFIX, SessionStore, StorageError, companion_suffixes,
                                   companions, move_companions, unlink_with_companions,
                                   write_json_beside)

log = logging.getLogger("kvproxy.disk")


class SaveFailed(StorageError):
    """A save the slot folder could not take (no room, a failed or short write): the
    session's old file and sidecar are as they were, or both removed."""


class NotAsRecorded(StorageError):
    """llama-server saved another token count than kvproxy recorded in the slot: the slot
    holds something else, so the save is discarded and the old file and sidecar stay."""


def temp_path(store: SessionStore, stem: str) -> Path:
    """Where llama-server writes a save before it is checked (a name its filename check accepts)."""
    return store.root / f"{stem}{TEMP_SUFFIX}"


def discard(path: Path) -> None:
    """Delete a file (and a slot file's companions), logging what cannot be deleted."""
    try:
        unlink_with_companions(path)
    except OSError as exc:
        log.warning("could not remove %s: %s", path.name, exc)


def checked_save(write: Callable[[str], dict], store: SessionStore, stem: str,
                 describe: Callable[[dict, int], dict],
                 as_recorded: Callable[[object], bool] = lambda n_saved: True) -> dict | None:
    """Have llama-server save the slot under a temporary name (``write(name)``: the caller's
    call to llama-server, which answers with what it wrote), check it, then put it and its
    sidecar (the one there with the save's fields, ``describe(answer, size)``, laid over it)
    in place. Returns the sidecar, or None when the slot is empty (an empty save never
    replaces a file). A save whose token count
    ``as_recorded`` refuses raises NotAsRecorded; one that llama-server or the folder cannot
    complete raises SaveFailed; both leave the old file and sidecar untouched."""
    tmp = temp_path(store, stem)
    try:
        if tmp.is_file() or tmp.is_symlink() or companions(tmp):  # left by an interrupted save
            unlink_with_companions(tmp)
        answer = write(tmp.name)
    except (UpstreamError, OSError) as exc:
        discard(tmp)
        reason = exc.message if isinstance(exc, UpstreamError) else exc
        raise SaveFailed(f"could not save {stem}.bin: {reason}; the previous file is kept") from exc
    if not answer.get("n_saved"):
        discard(tmp)
        return None
    if not as_recorded(answer.get("n_saved")):
        discard(tmp)
        raise NotAsRecorded(f"llama-server saved {answer.get('n_saved')} tokens of the slot, "
                            f"not what kvproxy recorded there; {stem}.bin is kept as it was")
    described = describe(answer, checked_size(store, stem, answer))
    described["companions"] = companion_suffixes(tmp)   # written beside it by llama-server
    return install(store, stem, described)


def checked_size(store: SessionStore, stem: str, answer: dict) -> int:
    """The size of the temporary file when it matches llama-server's count, else StorageError."""
    tmp = temp_path(store, stem)
    try:
        size = tmp.stat().st_size
    except FileNotFoundError:
        raise SaveFailed(f"llama-server reported saving {tmp.name}, but it is not in the slot "
                           f"folder {store.root}: KVPROXY_SLOT_DIR must be the folder of "
                           f"llama-server's --slot-save-path") from None
    written = answer.get("n_written")
    if not isinstance(written, int) or written <= 0 or size != written:
        discard(tmp)
        raise SaveFailed(f"the save of {stem}.bin is incomplete (llama-server wrote {written} "
                           f"bytes, the file has {size}); the previous file is kept")
    return size


def install(store: SessionStore, stem: str, described: dict) -> dict:
    """Rename the checked save over ``<stem>.bin``, its companions over the old file's (old
    companions the save has not are deleted), and its new sidecar over the old one: the
    sidecar there with the save's fields (``described``) laid over it, read and written
    under the stem's lock, so what an answer wrote into it while the save ran (a hit, a
    restore) is kept. Everything that needs disk space happens before the first rename. A
    process killed at any step leaves what ``sweep`` finishes (the new sidecar is written,
    matching its file and naming its companions) or rolls back (the old file, companions and
    sidecar are still in place). Returns the new sidecar."""
    tmp = temp_path(store, stem)
    try:
        with store.stem_lock(stem):   # nobody reads or rewrites the pair half put in place
            try:
                sidecar = {**store.merged_sidecar(stem, {}), **described}
                tmp_sidecar = write_json_beside(store.sidecar_path(stem), sidecar)
            except OSError as exc:
                discard(tmp)
                raise SaveFailed(f"cannot write the sidecar of {stem}.bin: "
                                 f"{exc.strerror or exc}; the previous file is kept") from exc
            rename_in(store, stem, tmp, tmp_sidecar, sidecar)
    except SaveFailed:
        raise
    except StorageError as exc:       # the lock: nothing renamed yet
        discard(tmp)
        raise SaveFailed(f"{exc}; the previous file of {stem}.bin is kept") from exc
    return sidecar


def rename_in(store: SessionStore, stem: str, tmp: Path, tmp_sidecar: Path,
              sidecar: dict) -> None:
    """``install``'s renames: the file, its companions, then its sidecar."""
    try:
        os.replace(tmp, store.bin_path(stem))
    except OSError as exc:
        discard(tmp)
        discard(tmp_sidecar)
        raise SaveFailed(f"cannot rename the save of {stem}.bin in the slot folder: "
                           f"{exc.strerror or exc}") from exc
    try:
        move_companions(tmp, store.bin_path(stem), set(sidecar.get("companions") or ()))
        os.replace(tmp_sidecar, store.sidecar_path(stem))
    except OSError as exc:  # the new file does not match the old sidecar: both go
        discard(tmp)
        discard(tmp_sidecar)
        discard(store.bin_path(stem))
        discard(store.sidecar_path(stem))
        store.notes.drop(stem)        # what answers taught it goes with it
        raise SaveFailed(f"cannot rename the sidecar of {stem}.bin: {exc.strerror or exc}; "
                           f"the file and its sidecar are removed") from exc
