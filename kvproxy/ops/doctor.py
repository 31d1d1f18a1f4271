"""``kvproxy doctor``: is a running llama-server set up the way kvproxy needs it?

One line per check, each with the fix. The slot checks are kvproxy's own start-up checks
(``ops.startup.contract_checks`` and the restore probe of ``slots.restore_probe``), run over
the slot folder kvproxy would use, with every slot held as at start-up; the model's facts come
from its GGUF header (``upstream.gguf``). What llama-server does not report over HTTP (its RAM
cache, ``--swa-full``, the KV cache types, sleep mode) is read from its command line when it runs
on this machine.

Exit status: 0 kvproxy would work well, 1 it would work with a warning, 2 it would not.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from kvproxy.config import ConfigError, Settings, check_slot_dir
from kvproxy.ops.startup import contract_checks
from kvproxy.slots.restore_check import RECURRENT, cause_of
from kvproxy.slots.restore_probe import ProbeVerdict, prove_restores
from kvproxy.upstream import gguf
from kvproxy.upstream.llama import LlamaClient, UpstreamError, UpstreamUnavailable

OK, SKIP, WARN, FAIL = "ok", "skip", "warn", "FAIL"
EXIT = {OK: 0, SKIP: 0, WARN: 1, FAIL: 2}
VERDICTS = {0: "kvproxy would work well with this llama-server",
            1: "kvproxy would work, with the warnings above",
            2: "kvproxy would not work with this llama-server: fix the FAIL lines first"}
SMALL_CONTEXT = 2048      # tokens per slot below which a conversation soon runs out
LLAMA_CACHE_RAM_DEFAULT = 8192   # MiB: llama-server's --cache-ram when not given
FLAGS_UNKNOWN = "llama-server's flags cannot be read from here (another machine or user)"


@dataclass(frozen=True)
class Check:
    level: str
    name: str
    text: str

    def line(self) -> str:
        return f"{self.level:<4}  {self.name:<15} {self.text}"


# -- llama-server's command line -------------------------------------------------------------
class Flags:
    """llama-server's command-line flags, as given (``args``), read by name."""

    def __init__(self, args: list[str]):
        self.args = list(args)

    def value(self, *names: str) -> str | None:
        for i, arg in enumerate(self.args):
            for name in names:
                if arg == name and i + 1 < len(self.args):
                    return self.args[i + 1]
                if arg.startswith(name + "="):
                    return arg.split("=", 1)[1]
        return None

    def has(self, *names: str) -> bool:
        return any(arg in names or arg.split("=", 1)[0] in names for arg in self.args)


def _local(host: str) -> bool:
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified or host in _own_addresses()


def _own_addresses() -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return set()


def local_flags(upstream: str, proc: Path = Path("/proc")) -> Flags | None:
    """The flags of the llama-server process on this machine that listens on the upstream's
    port, or None (another machine, another user's process, no /proc)."""
    parts = urlsplit(upstream)
    if not _local(parts.hostname or ""):
        return None
    port = str(parts.port or (443 if parts.scheme == "https" else 80))
    try:
        entries = list(proc.iterdir())
    except OSError:
        return None
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if not args or "llama-server" not in os.path.basename(args[0]):
            continue
        flags = Flags([a for a in args[1:] if a])
        if (flags.value("--port") or os.environ.get("LLAMA_ARG_PORT") or "8080") == port:
            return flags
    return None


# -- the checks ----------------------------------------------------------------------------------
def diagnose(settings: Settings, flags: Flags | None, wait: float = 10) -> list[Check]:
    """Every check: the llama-server at ``settings.upstream``, then the shared store when
    ``KVPROXY_STORE_URL`` names one."""
    return llama_checks(settings, flags, wait) + shared_store(settings)


def llama_checks(settings: Settings, flags: Flags | None, wait: float = 10) -> list[Check]:
    """Every check against the llama-server at ``settings.upstream``, in order."""
    url = settings.upstream
    client = LlamaClient(url, settings.connect_timeout, min(settings.read_timeout, 120),
                         settings.slot_action_timeout, api_key=settings.upstream_api_key)
    checks: list[Check] = []
    try:
        props = client.view.fresh_props()
    except UpstreamUnavailable as exc:
        return [Check(FAIL, "reachable", f"{exc}: start it, or point --upstream "
                                         "(KVPROXY_UPSTREAM) at it")]
    except UpstreamError as exc:
        if exc.status in (401, 403) or getattr(exc, "unauthorized", False):
            return [Check(OK, "reachable", f"llama-server answers at {url}"),
                    Check(FAIL, "api key", "llama-server asks for an API key (--api-key) that "
                          "kvproxy does not send: set KVPROXY_UPSTREAM_API_KEY (--upstream-api-key) "
                          "to it")]
        if exc.status == 503:
            return [Check(FAIL, "reachable", f"llama-server at {url} is still loading its model: "
                                             "run kvproxy doctor again once it is up")]
        return [Check(FAIL, "reachable", f"llama-server at {url} answered GET /props with "
                                         f"{exc.status} ({exc.message}): is it llama-server?")]
    model_path = str(props.get("model_path") or "")
    checks.append(Check(OK, "reachable", f"llama-server answers at {url} (build "
                                         f"{props.get('build_info') or 'unknown'})"))
    if flags is not None and flags.has("--api-key", "--api-key-file"):
        checks.append(Check(OK, "api key", "llama-server runs with --api-key: kvproxy sends "
                            "KVPROXY_UPSTREAM_API_KEY") if settings.upstream_api_key else
                      Check(FAIL, "api key", "llama-server runs with --api-key: set "
                            "KVPROXY_UPSTREAM_API_KEY (--upstream-api-key) to its key"))
    elif settings.upstream_api_key:
        checks.append(Check(OK, "api key", "kvproxy sends KVPROXY_UPSTREAM_API_KEY"))
    else:
        checks.append(Check(OK, "api key", "llama-server asks for no API key"))
    router = props.get("role") == "router"
    if router:
        checks.append(Check(OK, "router mode", "llama-server serves several models "
                            "(--models-dir): kvproxy serves each one with its own slots; the slot "
                            "checks and the restore check run per model as requests arrive"))
        checks += router_folder(settings, flags)
    else:
        checks.append(Check(OK, "router mode", f"one model: {Path(model_path).name or 'unknown'}"))
        slot_checks, verdict = contract(settings, client, wait)
        checks += slot_checks
        checks += context(props)
        checks += ram_cache(props, flags)
        checks += kv_layout(props, flags)
        checks += kv_cache(verdict, flags)
        checks += restores(verdict)
        checks += model_memory(model_path, verdict, flags)
    checks += sleep(props, flags)
    return checks


def router_folder(settings: Settings, flags: Flags | None) -> list[Check]:
    root = os.path.realpath(settings.slot_dir)
    if flags is None:
        return [Check(SKIP, "slot folder", f"{FLAGS_UNKNOWN}: start llama-server with "
                                           f"--slot-save-path {root}")]
    saving = flags.value("--slot-save-path")
    if not saving:
        return [Check(FAIL, "slot saving", f"llama-server has slot saving off: start it with "
                                           f"--slot-save-path {root}")]
    if os.path.realpath(saving) != root:
        return [Check(FAIL, "slot folder", f"llama-server writes slot files into {saving}, kvproxy "
                      f"reads {root}: start llama-server with --slot-save-path {root}, or set "
                      f"--slot-dir (KVPROXY_SLOT_DIR) to {saving}")]
    return [Check(OK, "slot folder", f"llama-server writes slot files into {root}, the folder "
                                     "kvproxy reads")]


OK_TEXT = {"slots": "the slot(s) kvproxy would drive exist",
           "slot listing": "llama-server lists its slots (GET /slots)",
           "slot saving": "slot saving is on (--slot-save-path)",
           "slot folder": "llama-server writes slot files into {root}, the folder kvproxy reads"}


def contract(settings: Settings, client: LlamaClient, wait: float
             ) -> tuple[list[Check], ProbeVerdict | None]:
    """kvproxy's start-up checks and restore probe, over the slot folder kvproxy would use."""
    from kvproxy.assemble import build_switch
    from kvproxy.storage.store import SessionStore
    try:
        check_slot_dir(settings.slot_dir)
    except ConfigError as exc:
        return [Check(FAIL, "slot folder", f"{exc} (--slot-dir)")], None
    switch = build_switch(settings, client, SessionStore(settings.slot_dir))
    checks: list[Check] = []
    verdict = None
    try:
        with switch.holding(wait) as held:
            if not held:
                return [Check(WARN, "slot saving", f"a slot stayed busy for {wait:g} s (kvproxy is "
                              "serving): the checks that save were not run; run kvproxy doctor "
                              "again when it is idle")], None
            for name, problem in contract_checks(client, switch):
                checks.append(Check(FAIL, name, problem) if problem else
                              Check(OK, name, OK_TEXT[name].format(root=switch.store.root)))
                if problem:
                    return checks, None
            verdict = prove_restores(switch, client)
    except (UpstreamError, UpstreamUnavailable) as exc:
        checks.append(Check(FAIL, "slot saving", f"llama-server failed during the slot checks: "
                                                 f"{exc}; see its log"))
    return checks, verdict


def context(props: dict) -> list[Check]:
    total = props.get("total_slots")
    n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
    if not isinstance(total, int) or not isinstance(n_ctx, int):
        return [Check(SKIP, "context", "llama-server did not report its slots and context")]
    text = f"{total} slot(s) of {n_ctx} tokens each"
    if n_ctx < SMALL_CONTEXT:
        return [Check(WARN, "context", f"{text}: conversations soon run out; raise -c (llama-server "
                                       "splits it between the -np slots)")]
    return [Check(OK, "context", text)]


def ram_cache(props: dict, flags: Flags | None) -> list[Check]:
    total = props.get("total_slots")
    if not isinstance(total, int) or total <= 1:
        return [Check(OK, "ram cache", "one slot: llama-server's RAM prompt cache is safe")]
    fix = "start llama-server with --cache-ram 0 --slot-prompt-similarity 0"
    if flags is None:
        return [Check(SKIP, "ram cache", f"{FLAGS_UNKNOWN}: with {total} slots {fix}")]
    ram = flags.value("--cache-ram", "-cram")
    similarity = flags.value("--slot-prompt-similarity", "-sps")
    wrong = []
    if (int(ram) if ram and ram.lstrip("-").isdigit() else LLAMA_CACHE_RAM_DEFAULT) != 0:
        wrong.append(f"its RAM prompt cache is on (--cache-ram {ram or 'default'})")
    if similarity is None or _number(similarity) != 0:
        wrong.append("it picks slots by prompt similarity")
    if wrong:
        return [Check(WARN, "ram cache", f"{total} slots and {' and '.join(wrong)}: a conversation "
                                         f"can land in another's slot; {fix}")]
    return [Check(OK, "ram cache", f"{total} slots, RAM prompt cache and similarity pick off")]


def kv_layout(props: dict, flags: Flags | None) -> list[Check]:
    """Several slots in one unified KV pool: attention then covers every slot's cells, so the
    conversations kvproxy keeps idle in other slots slow the active one (``make
    bench-idle-residents``: 0.64x prefill, 0.84x decode beside three idle 2,530-token
    conversations; with a stream per slot, no measurable cost). llama-server unifies the pool
    on ``--kv-unified``, and when ``-np`` is left out (4 slots)."""
    total = props.get("total_slots")
    if not isinstance(total, int) or total <= 1:
        return []
    fix = "start llama-server with an explicit -np and without --kv-unified"
    if flags is None:
        return [Check(SKIP, "kv layout", f"{FLAGS_UNKNOWN}: with {total} slots {fix}")]
    unified = flags.has("-kvu", "--kv-unified") or not flags.has("-np", "--parallel")
    if unified and not flags.has("-no-kvu", "--no-kv-unified"):
        return [Check(WARN, "kv layout", f"{total} slots share one KV pool: the conversations "
                                         f"kvproxy keeps idle in the other slots slow the active "
                                         f"one's attention (about a third of its prefill); {fix}")]
    return [Check(OK, "kv layout", f"{total} slots, a KV stream each: idle conversations cost "
                                   "the active one nothing")]


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def kv_cache(verdict: ProbeVerdict | None, flags: Flags | None) -> list[Check]:
    given = None
    if flags is not None:
        given = (f"{flags.value('--cache-type-k', '-ctk') or 'f16'}/"
                 f"{flags.value('--cache-type-v', '-ctv') or 'f16'}")
    if verdict is not None and verdict.kv_format:
        return [Check(OK, "kv cache", f"{verdict.kv_format} (from a probe slot file); saved "
                                      "sessions restore only with the same cache types and model")]
    if given:
        return [Check(OK, "kv cache", f"K/V types {given}; saved sessions restore only with the "
                                      "same cache types and model")]
    return [Check(SKIP, "kv cache", "the KV cache types are not known (no probe slot file)")]


def restores(verdict: ProbeVerdict | None) -> list[Check]:
    if verdict is None:
        return [Check(SKIP, "restores", "the restore probe did not run")]
    if verdict.honoured is None:
        return [Check(WARN, "restores", f"{verdict.detail}; kvproxy judges restores on real "
                                        "requests instead")]
    if verdict.honoured:
        return [Check(OK, "restores", f"a restored slot is reused ({verdict.detail})")]
    return [Check(WARN, "restores", f"llama-server reports restores but recomputes them "
                                    f"({verdict.detail}): kvproxy keeps sessions apart and "
                                    "computes each afresh; see the model lines for the fix")]


def model_memory(model_path: str, verdict: ProbeVerdict | None,
                 flags: Flags | None) -> list[Check]:
    """Sliding window and hybrid/recurrent memory, from the model's GGUF header."""
    metadata = gguf.file_facts(model_path)[0] if model_path else {}
    if not metadata:
        where = model_path or "(llama-server did not say)"
        return [Check(SKIP, "sliding window", f"cannot read the model file {where} from here"),
                Check(SKIP, "hybrid model", f"cannot read the model file {where} from here")]
    checks = []
    window = gguf.sliding_window(metadata)
    honoured = verdict.honoured if verdict is not None else None
    swa_full = flags.has("--swa-full") if flags is not None else None
    if window is None:
        checks.append(Check(OK, "sliding window", "not a sliding-window model"))
    elif honoured is False or swa_full is False:
        checks.append(Check(WARN, "sliding window", f"a sliding-window model (window {window}) "
                            "without --swa-full: llama-server keeps only the window of those "
                            "layers, so a restored session is recomputed; start llama-server "
                            "with --swa-full"))
    elif honoured or swa_full:
        checks.append(Check(OK, "sliding window", f"a sliding-window model (window {window}) with "
                                                  "its full cache kept (--swa-full)"))
    else:
        checks.append(Check(WARN, "sliding window", f"a sliding-window model (window {window}); "
                            "whether --swa-full is on cannot be told from here: start "
                            "llama-server with --swa-full"))
    arch = str(metadata.get("general.architecture") or "unknown")
    if arch.startswith(RECURRENT):
        checks.append(Check(WARN, "hybrid model", cause_of(metadata)))
    else:
        checks.append(Check(OK, "hybrid model", f"{arch}: attention only, its cache saves whole"))
    return checks


def sleep(props: dict, flags: Flags | None) -> list[Check]:
    idle = flags.value("--sleep-idle-seconds") if flags is not None else None
    if props.get("is_sleeping") or (idle is not None and (_number(idle) or 0) > 0):
        return [Check(WARN, "sleep mode", "llama-server sleeps when idle (--sleep-idle-seconds) "
                      "and drops every slot's cache: a conversation's turns since kvproxy last "
                      "saved it are recomputed when it returns; start llama-server without "
                      "--sleep-idle-seconds")]
    if flags is None:
        return [Check(OK, "sleep mode", "llama-server is awake (whether it sleeps when idle "
                                        "cannot be read from here)")]
    return [Check(OK, "sleep mode", "llama-server does not sleep when idle")]


STORE_FIXES = {
    "store": "start the store, or fix KVPROXY_STORE_URL, AWS_ENDPOINT_URL and the credentials "
             "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or AWS_PROFILE); until then kvproxy serves "
             "from its slot folder and uploads wait",
    "store writes": "give kvproxy's key the right to put, get and delete objects under the "
                    "store URL's prefix",
    "store conditions": "use an S3 store that honours conditional PUTs (SeaweedFS, MinIO, "
                        "AWS S3), or leave KVPROXY_STORE_URL empty"}


def shared_store(settings: Settings) -> list[Check]:
    """The bucket of ``KVPROXY_STORE_URL``: reachable, writable, conditional PUTs honoured
    (none when the setting is empty)."""
    if not getattr(settings, "store_url", ""):
        return []
    from kvproxy.storage.shared.bucket import Bucket
    from kvproxy.storage.shared.location import StoreLocation
    from kvproxy.storage.shared.probe import probe
    bucket = Bucket(StoreLocation.parse(settings.store_url), min(settings.store_timeout, 10))
    return [Check(OK, f.name, f.text) if f.ok else
            Check(FAIL, f.name, f"{f.text}: {STORE_FIXES[f.name]}") for f in probe(bucket)]


def exit_status(checks: list[Check]) -> int:
    return max((EXIT[check.level] for check in checks), default=0)
