"""kvproxy's version, in a module of its own: the package metadata, the admin API, the
status page and ``kvproxy --version`` read it without importing the app factory."""
__version__ = "0.1.0"
