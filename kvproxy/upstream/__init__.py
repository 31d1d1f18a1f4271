"""Talking to llama-server: the HTTP client, its one view of the server, file header readers."""
