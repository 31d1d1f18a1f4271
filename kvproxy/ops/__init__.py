"""The operator's side: health, metrics, admin API, status page, CLI, start-up checks."""
