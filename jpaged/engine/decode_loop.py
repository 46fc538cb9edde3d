"""Moved to jpaged.worker.decode_loop; the old names are kept for one release."""

from jpaged._deprecation import moved_names

__getattr__ = moved_names(__name__, {name: "jpaged.worker.decode_loop" for name in (
    "LoopInput", "LoopOutput", "decode_loop", "padding_input")})
