"""numkv's version: a leaf module, so nothing imports back into the package ``__init__``."""

__version__ = "0.2.0.dev0"
