"""Model definitions, looked up by the checkpoint's architecture name (``registry.py``)."""
