"""The slot folder: slot files, their sidecars and the state file; checked, swept and budgeted."""
