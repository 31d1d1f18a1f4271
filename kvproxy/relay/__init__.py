"""The application layer: one request from its caller through the slot switch to llama-server."""
