"""One view of a llama-server: what it says about itself, kept in one cache.

Its ``/props`` and ``/v1/models`` (and, behind a router, its listing of models) are read
by the fingerprint a swap plans with, by the switch per model, by the served model's
facts the APIs show, and by the status page. Each reader says how fresh an answer must
be, and every answer asked for one of them is kept here for the others:

- ``props(max_age)``, ``listing(max_age)``, ``entries(fresh)``: reused for a few seconds
  (``fresh_props()``: asked now, for the checks that judge the server as it is);
- ``maker()`` / ``ask_maker()``: the facts a fingerprint is made of, asked together with
  the connection of the last slot call before them (its "witness"): reused while that
  connection is still open (``proven``), since llama-server has not restarted;
- ``look()``: the status page's health check, asked every time with short bounds over a
  connection of its own (never the one whose being open vouches for the slots).

Nothing here decides what the answers mean for a slot (``slots.plan`` does).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import requests

from kvproxy.errors import UpstreamError, UpstreamUnavailable

if TYPE_CHECKING:
    from kvproxy.upstream.llama import LlamaClient

log = logging.getLogger("kvproxy.switch")

LISTING_TTL = 2.0      # seconds the router's model listing is reused (a request's route)
PROPS_TTL = 10.0       # seconds /props is reused (the router's role, the slot's context)
FACTS_TTL = 10.0       # seconds the served model's facts are reused (the APIs' model lists)
LOOK_TIMEOUT = (2, 5)  # the status page asks with short bounds: it refreshes every few seconds


@dataclass(frozen=True)
class Asked:
    """One answer of llama-server and when it was asked (``time.monotonic``)."""

    value: Any
    at: float


@dataclass(frozen=True)
class Maker:
    """What a fingerprint is made of, asked together: ``/props``, ``/v1/models`` and
    ``/lora-adapters``, and the connection of the last slot call before them."""

    witness: Any
    props: dict
    models: dict
    adapters: list


@dataclass(frozen=True)
class Look:
    """The status page's look at llama-server: ``status`` ok, unreachable or unhealthy;
    the answers it got (None: not asked, or failed) and the first failure after /health."""

    status: str
    error: str | None = None
    props: dict | None = None
    models: dict | None = None
    adapters: list | None = None
    slots: list | None = None


class ServerView:
    """What one llama-server (or one model behind its router) says about itself, asked as
    rarely as each reader allows."""

    def __init__(self, client: "LlamaClient", clock: Callable[[], float] = time.monotonic):
        self.client = client
        self.clock = clock
        self._answers: dict[str, Asked] = {}
        self._maker: Maker | None = None
        self._router: bool | None = None
        self._facts: Asked | None = None
        self._facts_lock = threading.Lock()
        self._look_http: requests.Session | None = None

    # -- reused for a few seconds ------------------------------------------------
    def _fresh(self, name: str, max_age: float) -> Asked | None:
        asked = self._answers.get(name)
        return asked if asked is not None and self.clock() - asked.at < max_age else None

    def _keep(self, name: str, value: Any) -> Any:
        self._answers[name] = Asked(value, self.clock())
        return value

    def props(self, max_age: float = PROPS_TTL, autoload: bool = True) -> dict:
        """``/props``, reused for ``max_age`` seconds; asked with ``autoload=False``, a model
        behind a router that is not loaded answers 400 rather than being loaded."""
        asked = self._fresh("props", max_age)
        return asked.value if asked is not None else self.fresh_props(autoload)

    def fresh_props(self, autoload: bool = True) -> dict:
        """``/props`` asked now, whatever is kept (the start-up check and ``kvproxy doctor``
        judge llama-server as it is); the answer serves the other readers."""
        return self._keep("props", self.client.props(autoload=autoload))

    def listing(self, max_age: float = LISTING_TTL) -> dict:
        """``/v1/models`` (of ``client.model`` only, behind a router), reused for ``max_age``
        seconds."""
        asked = self._fresh("models", max_age)
        return asked.value if asked is not None else self._keep("models", self.client.models())

    def entries(self, fresh: bool = False) -> list[dict]:
        """The router's models (``/v1/models``), each with its status; cached briefly."""
        listing = self.listing(0 if fresh else LISTING_TTL)
        return [e for e in (listing.get("data") if isinstance(listing, dict) else None) or []
                if isinstance(e, dict) and isinstance(e.get("id"), str)]

    def is_router(self) -> bool:
        """Whether llama-server is a router of several models (asked once it answers). A
        router drops kept-alive connections while it loads and unloads models, so every
        call to it then opens its own."""
        if self._router is None:
            try:
                props = self.props()
            except (UpstreamError, UpstreamUnavailable):
                return False
            self._router = props.get("role") == "router"
            if self._router:
                log.info("llama-server is a router of several models: a switch per model")
                self.client.http.headers["Connection"] = "close"
        return self._router

    # -- the fingerprint's facts: reused while llama-server provably did not restart --
    def maker(self) -> Maker | None:
        """The fingerprint's facts as last asked (None: not yet, or forgotten)."""
        return self._maker

    def ask_maker(self) -> Maker:
        """Ask the fingerprint's facts now (the witness first: the facts are at least as new
        as the connection that vouches for them); the answers serve the other readers too."""
        witness = self.client.witness()
        props = self._keep("props", self.client.props())
        models = self._keep("models", self.client.models())
        maker = self._maker = Maker(witness, props, models, self._adapters())
        return maker

    def _adapters(self) -> list:
        """The LoRA adapters; a llama-server that does not list them (an older build without
        the route, a stub) is taken to apply none, as before they were asked."""
        try:
            return self.client.lora_adapters()
        except (UpstreamError, UpstreamUnavailable):
            return []

    def proven(self, maker: Maker | None) -> bool:
        """Whether llama-server provably is the process ``maker`` was asked of: the
        connection of the last slot call before it is still open."""
        return maker is not None and self.client.still_open(maker.witness)

    def forget_maker(self) -> None:
        """Ask the fingerprint's facts again next time: llama-server changed (restarted, or
        its LoRA adapters were set)."""
        self._maker = None

    # -- the served model's facts, as the APIs list it ---------------------------------
    def model_facts(self, requested: object = None, name: str = "") -> dict:
        """``/props`` and ``/v1/models``, cached briefly, plus the served name (``name``, else
        the model's id as a file name); behind a router, of the model ``requested`` names
        (else its first)."""
        if self.is_router():
            entries = self.entries()
            model = pick_model(requested, entries) or (entries[0]["id"] if entries else None)
            return self._router_facts(next(e for e in entries if e["id"] == model)) \
                if model else self._router_facts({"id": "none"})
        with self._facts_lock:
            if self._facts and self.clock() - self._facts.at < FACTS_TTL:
                return self._facts.value
            props = self.props(FACTS_TTL)
            models = self.listing(0)
            entry = (models.get("data") or [{}])[0]
            upstream_id = entry.get("id") or props.get("model_alias") or "model"
            served = name or upstream_id.rsplit("/", 1)[-1].removesuffix(".gguf")
            facts = {"props": props, "model": entry, "upstream_id": upstream_id, "name": served,
                     "listing": models}
            self._facts = Asked(facts, self.clock())
            return facts

    def all_model_facts(self, name: str = "") -> list[dict]:
        """``model_facts`` of every model llama-server serves (one, unless it is a router)."""
        if not self.is_router():
            return [self.model_facts(name=name)]
        return [self._router_facts(entry) for entry in self.entries()]

    def _router_facts(self, entry: dict) -> dict:
        """One model behind the router, without loading it: its facts from the listing (the
        model file is the ``--model`` of its status), its /props only while it is loaded."""
        model = entry["id"]
        args = (entry.get("status") or {}).get("args") or []
        path = next((args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--model", "-m")), "")
        try:
            loaded = is_loaded(entry)
            props = self.client.for_model(model).props(autoload=False) if loaded else {}
        except (UpstreamError, UpstreamUnavailable):
            props = {}
        props = {**props, "model_path": props.get("model_path") or path}
        return {"props": props, "model": entry, "upstream_id": model, "name": model,
                "listing": {"object": "list", "data": [entry]}}

    # -- the status page's look: asked every time, never raising ---------------------
    def look(self, timeout: tuple[float, float] = LOOK_TIMEOUT) -> Look:
        """Health, props, models, LoRA adapters and slots, asked now with short bounds over a
        connection of its own; what it learns of /props and /v1/models serves the others."""
        if self._look_http is None:
            http = requests.Session()
            http.trust_env = False  # a local hop, as the client's
            http.headers.update({k: v for k, v in self.client.http.headers.items()
                                 if k == "Authorization"})
            self._look_http = http

        def get(path: str) -> Any:
            response = self._look_http.get(self.client.base_url + path, timeout=timeout,
                                           allow_redirects=False)
            if response.status_code >= 400:
                try:
                    message = (response.json().get("error") or {}).get("message")
                except (ValueError, AttributeError):
                    message = None
                raise RuntimeError(message or f"HTTP {response.status_code}")
            return response.json()

        try:
            get("/health")
        except requests.RequestException as exc:
            return Look("unreachable", exc.__class__.__name__)
        except (RuntimeError, ValueError) as exc:
            return Look("unhealthy", str(exc))
        failures = (requests.RequestException, RuntimeError, ValueError)
        try:
            props = self._keep("props", get("/props"))
            models = self._keep("models", get("/v1/models"))
        except failures as exc:
            return Look("ok", f"{exc.__class__.__name__}: {exc}")
        try:
            adapters = get("/lora-adapters")
        except failures:
            adapters = []   # as the fingerprint's: a server that cannot say applies none
        try:
            return Look("ok", None, props, models, adapters, get("/slots"))
        except failures as exc:
            return Look("ok", f"{exc.__class__.__name__}: {exc}", props, models, adapters)


# -- the router's listing, read -------------------------------------------------
def is_loaded(entry: dict | None) -> bool:
    """Whether the router's entry of a model says it is loaded."""
    status = (entry or {}).get("status")
    return isinstance(status, dict) and status.get("value") == "loaded"


def model_names(entry: dict) -> set[str]:
    """The names a request may use for a router entry: its id and aliases, any case, with or
    without ``.gguf`` or an Ollama-style ``:tag``."""
    names = {entry.get("id")} | set(entry.get("aliases") or [])
    return {n.lower() for n in names if isinstance(n, str) and n}


def pick_model(requested: object, entries: list[dict]) -> str | None:
    """The router's id of the model a request names, or None."""
    if not isinstance(requested, str) or not requested.strip():
        return None
    wanted = requested.strip().lower()
    candidates = [wanted, wanted.removesuffix(".gguf")]
    if ":" in wanted:
        candidates.append(wanted.rsplit(":", 1)[0])
    for name in candidates:
        for entry in entries:
            if name in model_names(entry):
                return entry["id"]
    return None
