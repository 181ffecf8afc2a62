"""TAPE_PURE=1 hides the C extensions before any module here loads (protocol/extensions.py)."""

from tape.protocol import extensions  # noqa: F401
