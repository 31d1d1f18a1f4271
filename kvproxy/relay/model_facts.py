"""What llama-server serves, as the model routes describe it: ``/props``, ``/v1/models``,
the served name, and the model file's GGUF header when it is readable from here.

``ModelFacts.of`` is the one reader of these for the request path (the Ollama and OpenAI
model routes, the context-size check); it caches them briefly. Behind llama-server's
router each model has its own, read without loading it.
"""
from __future__ import annotations

import threading
import time

from kvproxy.config import Settings
from kvproxy.slots.models import ModelSwitches, is_loaded, pick_model
from kvproxy.upstream import gguf
from kvproxy.upstream.llama import LlamaClient, UpstreamError, UpstreamUnavailable

MODEL_FACTS_TTL = 10.0


class ModelFacts:
    """llama-server's model facts, cached for ``MODEL_FACTS_TTL`` seconds."""

    def __init__(self, settings: Settings, client: LlamaClient, models: ModelSwitches):
        self.settings = settings
        self.client = client
        self.models = models
        self._facts: tuple[float, dict] | None = None
        self._lock = threading.Lock()

    def of(self, requested: object = None) -> dict:
        """llama-server's /props and /v1/models, cached briefly, plus the served name; behind
        a router, of the model ``requested`` names (else its first)."""
        if self.models.is_router():
            entries = self.models.entries()
            model = pick_model(requested, entries) or (entries[0]["id"] if entries else None)
            return self._router_facts(next(e for e in entries if e["id"] == model)) \
                if model else self._router_facts({"id": "none"})
        with self._lock:
            if self._facts and time.monotonic() - self._facts[0] < MODEL_FACTS_TTL:
                return self._facts[1]
            props = self.models.props(MODEL_FACTS_TTL)
            models = self.client.models()
            entry = (models.get("data") or [{}])[0]
            upstream_id = entry.get("id") or props.get("model_alias") or "model"
            name = self.settings.model_name or upstream_id.rsplit("/", 1)[-1].removesuffix(".gguf")
            facts = {"props": props, "model": entry, "upstream_id": upstream_id, "name": name,
                     "listing": models}
            self._facts = (time.monotonic(), facts)
            return facts

    def every(self) -> list[dict]:
        """``of`` every model llama-server serves (one, unless it is a router)."""
        if not self.models.is_router():
            return [self.of()]
        return [self._router_facts(entry) for entry in self.models.entries()]

    def _router_facts(self, entry: dict) -> dict:
        """One model behind the router, without loading it: its facts from the listing (the
        model file is the ``--model`` of its status), its /props only while it is loaded."""
        model = entry["id"]
        args = (entry.get("status") or {}).get("args") or []
        path = next((args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--model", "-m")), "")
        try:
            props = self.client.for_model(model).props(autoload=False) if is_loaded(entry) else {}
        except (UpstreamError, UpstreamUnavailable):
            props = {}
        props = {**props, "model_path": props.get("model_path") or path}
        return {"props": props, "model": entry, "upstream_id": model,
                "name": model,
                "listing": {"object": "list", "data": [entry]}}


def model_file(facts: dict) -> tuple[dict, int | None, float | None]:
    """The GGUF header, size and modification time of the model file the facts name, when
    kvproxy can read it (else ``({}, None, None)``)."""
    return gguf.file_facts(facts["props"].get("model_path") or "")
