"""The slot switch: which session each llama-server slot holds, and swapping it."""
