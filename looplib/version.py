"""looplib's version (one place: the package, tune's cache key)."""
__version__ = "0.1.0"
