"""Ollama API (placeholder: routes come with their issue)."""
from flask import Blueprint

blueprint = Blueprint("ollama", __name__)
