"""kvproxy's benchmarks: ``make bench`` (``python -m bench.run``), ``make bench-*`` and ``make soak``."""
