"""kvproxy benchmark: ``python -m bench.run`` (``make bench``); ``--quick`` for a smoke run."""
