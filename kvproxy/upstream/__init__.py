"""Talking to llama-server: the HTTP client and the GGUF header reader."""
