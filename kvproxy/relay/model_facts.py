"""What llama-server serves, as the model routes describe it: ``/props``, ``/v1/models``,
the served name, and the model file's GGUF header when it is readable from here.

``ModelFacts.of`` is the one reader of these for the request path (the Ollama and OpenAI
model routes, the context-size check), through the server's one view (``ServerView``, which
caches them briefly). Behind llama-server's router each model has its own, read without
loading it.
"""
from __future__ import annotations

from kvproxy.config import Settings
from kvproxy.slots.models import ModelSwitches
from kvproxy.upstream import gguf
from kvproxy.upstream.llama import LlamaClient


class ModelFacts:
    """llama-server's model facts, as the server's view has them."""

    def __init__(self, settings: Settings, client: LlamaClient, models: ModelSwitches):
        self.settings = settings
        self.client = client
        self.models = models

    def of(self, requested: object = None) -> dict:
        """llama-server's /props and /v1/models, cached briefly, plus the served name; behind
        a router, of the model ``requested`` names (else its first). The server's one view
        (``ServerView``) holds and caches them."""
        return self.models.view.model_facts(requested, self.settings.model_name)

    def every(self) -> list[dict]:
        """``of`` every model llama-server serves (one, unless it is a router)."""
        if not self.models.is_router():
            return [self.of()]
        return self.models.view.all_model_facts(self.settings.model_name)


def model_file(facts: dict) -> tuple[dict, int | None, float | None]:
    """The GGUF header, size and modification time of the model file the facts name, when
    kvproxy can read it (else ``({}, None, None)``)."""
    return gguf.file_facts(facts["props"].get("model_path") or "")
