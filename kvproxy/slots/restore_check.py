"""Whether llama-server honours restores, and switching restoring off for a while when it does not.

Sliding-window and hybrid models can report a successful restore and then
recompute the whole prompt (llama.cpp issues 26676, 28194, 25913). After a
restore, ``timings.cache_n`` of the next answer tells. Normal traffic also
reuses little after a restore (a new chat that diverges from a base snapshot,
an edited message, one id spanning conversations), so a restore counts as not
honoured only when the prompt starts with the restored tokens and llama-server
still reused next to none of them. That comparison reads the token ids at the
head of the slot file and tokenizes the prompt, and runs only when the cheap
check (``cache_n``) already looks bad.

The counts live in their own small file with its own short lock, so the admin
reset never waits for the slot.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

import filelock

from kvproxy.upstream import gguf, slot_file
from kvproxy.upstream.gguf import sliding_window
from kvproxy.upstream.llama import UpstreamError, UpstreamUnavailable
from kvproxy.storage.chunks import manifest
from kvproxy.storage.store import CHUNKED_SUFFIX, now_iso, read_json, write_json_atomic

log = logging.getLogger("kvproxy.switch")

CHECK_FILE = ".kvproxy-restore-check.json"
CHECK_LOCK = ".kvproxy-restore-check.lock"
# Honoured: the answer reused at least this share of the tokens it could reuse.
HONOURED_SHARE = 0.1
# Fewer tokens than this in common: not worth judging.
MIN_TOKENS_TO_VERIFY = 64


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def slot_file_tokens(path: Path) -> list[int] | None:
    """The token ids of a saved session's file: the head of a llama-server slot file
    (``slot_file.tokens``) or of the tail a manifest keeps (``<stem>.chunked``)."""
    if Path(path).name.endswith(CHUNKED_SUFFIX):
        return manifest.tokens(path)
    return slot_file.tokens(path)


def judge(restored: int, cache_n: int, reusable: int | None) -> str:
    """'honoured', 'not_honoured' or 'not_comparable' for one answer after a restore.

    ``reusable`` is how many leading tokens the prompt shares with the restored
    ones (None: not worked out yet, the cheap check decides if it can).
    """
    if restored < MIN_TOKENS_TO_VERIFY:
        return "not_comparable"
    if cache_n >= restored * HONOURED_SHARE:
        return "honoured"
    if reusable is None or reusable < MIN_TOKENS_TO_VERIFY:
        return "not_comparable"
    return "honoured" if cache_n >= reusable * HONOURED_SHARE else "not_honoured"


class RestoreCheck:
    """Unhonoured restores in a row per llama-server (fingerprint key), and the switch-off."""

    def __init__(self, root: Path, miss_limit: int, off_minutes: float):
        self.path = Path(root) / CHECK_FILE
        self.miss_limit = miss_limit
        self.off_minutes = off_minutes
        self._file_lock = filelock.FileLock(str(Path(root) / CHECK_LOCK), thread_local=False)
        # filelock with thread_local=False is re-entrant across threads: it keeps other
        # processes out, this keeps out the other threads of this one.
        self._thread_lock = threading.Lock()

    @contextlib.contextmanager
    def _locked(self):
        """The counts to read and write, for this thread alone (bounded: 5 s, then
        ``filelock.Timeout``)."""
        if not self._thread_lock.acquire(timeout=5):
            raise filelock.Timeout(self._file_lock.lock_file)
        try:
            with self._file_lock.acquire(timeout=5):
                yield
        finally:
            self._thread_lock.release()

    def _read(self) -> dict:
        return read_json(self.path) or {}

    def entries(self) -> dict:
        """The check file as it is: one entry per llama-server (fingerprint key)."""
        return self._read()

    def restoring_off(self, key: str) -> bool:
        return self.status(key)["restoring_off"]

    def status(self, key: str | None, now: datetime | None = None) -> dict:
        """The check for one llama-server (fingerprint key), or with ``None`` for the one whose
        state matters most (switched off, else most misses): what ``GET /api/sessions/current``
        shows without asking llama-server anything."""
        data = self._read()
        now = now or datetime.now(timezone.utc)
        if key is not None:
            return self._entry_status(data.get(key) or {}, now)
        shown = [self._entry_status(entry, now) for entry in data.values() if isinstance(entry, dict)]
        shown.sort(key=lambda st: (st["restoring_off"], st["misses_in_a_row"]), reverse=True)
        return shown[0] if shown else self._entry_status({}, now)

    @staticmethod
    def _entry_status(entry: dict, now: datetime) -> dict:
        off_until = entry.get("off_until")
        off = bool(off_until) and datetime.fromisoformat(off_until) > now
        return {"misses_in_a_row": int(entry.get("misses") or 0), "restoring_off": off,
                "off_since": entry.get("off_since") if off else None,
                "off_until": off_until if off else None,
                "last_miss_at": entry.get("last_miss_at"),
                "cause": entry.get("cause") if off else None}

    def record(self, key: str, honoured: bool, cause: str = "") -> tuple[int, bool]:
        """Count one judged restore; returns (misses in a row, whether restoring was just
        switched off). ``cause``: why llama-server does not honour them, kept with a
        switch-off so the status page and ``ps`` name the fix."""
        with self._locked():
            data = self._read()
            entry = data.get(key) or {}
            if honoured:
                if not entry.get("misses"):
                    return 0, False
                entry["misses"] = 0
            else:
                entry["misses"] = int(entry.get("misses") or 0) + 1
                entry["last_miss_at"] = now_iso()
            count = entry["misses"]
            switched = bool(self.miss_limit) and not honoured and count >= self.miss_limit
            if switched:
                now = datetime.now(timezone.utc)
                entry["off_since"] = now.isoformat(timespec="milliseconds")
                entry["off_until"] = (now + timedelta(minutes=self.off_minutes)).isoformat(
                    timespec="milliseconds")
                entry["misses"] = 0  # after the switch-off expires, count afresh
                entry["cause"] = cause or UNKNOWN_CAUSE
            data[key] = entry
            write_json_atomic(self.path, data)
            return count, switched

    def measured(self, key: str, honoured: bool, cause: str = "") -> None:
        """The restore probe's verdict for one llama-server: honoured ends a switch-off (the
        server was restarted with the fix), not honoured switches restoring off at once."""
        with self._locked():
            data = self._read()
            if honoured:
                if key not in data:
                    return
                del data[key]
            else:
                now = datetime.now(timezone.utc)
                data[key] = {"misses": 0, "last_miss_at": now_iso(), "cause": cause or UNKNOWN_CAUSE,
                             "off_since": now.isoformat(timespec="milliseconds"),
                             "off_until": (now + timedelta(minutes=self.off_minutes)).isoformat(
                                 timespec="milliseconds"),
                             "measured_by": "restore probe"}
            write_json_atomic(self.path, data)

    def reset(self) -> None:
        """Forget every count and switch-off (admin call)."""
        with self._locked():
            write_json_atomic(self.path, {})


UNKNOWN_CAUSE = ("llama-server reported restores and then recomputed the restored tokens; "
                 "its log says why")
# Architectures (GGUF general.architecture) whose recurrent state this llama.cpp build does not
# save with a slot (llama.cpp #25913, #28194; upstream PR #26004 adds it).
RECURRENT = ("mamba", "mamba2", "rwkv", "lfm2", "jamba", "granitehybrid", "falcon-h1",
             "qwen3next", "qwen35", "nemotron_h", "plamo2")


def cause_of(metadata: dict) -> str:
    """Why llama-server does not honour restores of the model with this GGUF header, and
    the fix: a sliding window without ``--swa-full``, or a hybrid/recurrent memory."""
    if sliding_window(metadata):
        return ("a sliding-window model: llama-server keeps only the window of its sliding "
                "layers; start llama-server with --swa-full")
    arch = str(metadata.get("general.architecture") or "")
    if arch.startswith(RECURRENT):
        return (f"a hybrid or recurrent model ({arch}): this llama.cpp build does not save its "
                "recurrent state with a slot (llama.cpp PR #26004), so sessions stay apart "
                "but cannot be restored")
    return UNKNOWN_CAUSE


def reusable_tokens(store, lease) -> int | None:
    """Leading tokens the prompt shares with the restored file (None: cannot tell)."""
    restored = store.saved_tokens(lease.restored_stem)
    if restored is None:
        return None
    try:
        return common_prefix(restored, lease.prompt.tokens())
    except (UpstreamError, UpstreamUnavailable, KeyError, TypeError) as exc:
        log.info("could not tokenize the prompt to check a restore: %s", exc)
        return None


def verify_restore(check: RestoreCheck, store, lease, cache_n: int, key: str) -> str:
    """Judge the answer after a restore, count it, log it; returns the verdict."""
    if lease.restored_tokens < MIN_TOKENS_TO_VERIFY:
        return "not_comparable"
    verdict = judge(lease.restored_tokens, cache_n, None)
    if verdict == "not_comparable" and lease.prompt is not None:
        verdict = judge(lease.restored_tokens, cache_n, reusable_tokens(store, lease))
    if verdict == "not_comparable":
        log.info("restore of session %s: %d tokens restored, %d reused; the prompt does not "
                 "start with them (new chat, edited message): not counted",
                 lease.session.id, lease.restored_tokens, cache_n)
        return verdict
    model_path = (lease.made_by or {}).get("model_path")
    cause = cause_of(gguf.file_facts(model_path)[0]) if model_path and verdict != "honoured" \
        else ""
    misses, switched = check.record(key, verdict == "honoured", cause)
    if verdict == "honoured":
        return verdict
    log.warning("restore of session %s not honoured: %d tokens restored, %d reused (%d in a row)",
                lease.session.id, lease.restored_tokens, cache_n, misses)
    store.update_sidecar(lease.restored_stem, {}, of_save=lease.restored_saved_at,
                         restore_not_honoured_at=now_iso())
    if switched:
        log.error("restoring switched off for this model for %g minutes after %d unhonoured "
                  "restores (%s); POST /api/sessions/restore-check/reset turns it back on",
                  check.off_minutes, misses, cause or UNKNOWN_CAUSE)
    return verdict
