"""What happened lately: counters for /metrics and recent activity, importing nothing of kvproxy."""
