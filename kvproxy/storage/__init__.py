"""The slot folder: slot files, their JSON sidecars, the state file, the disk budget."""
