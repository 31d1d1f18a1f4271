"""Anthropic API (placeholder: routes come with their issue)."""
from flask import Blueprint

blueprint = Blueprint("anthropic", __name__)
