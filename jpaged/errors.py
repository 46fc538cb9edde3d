"""Errors a request can cause, naming the parameter at fault.

They are ValueError and TypeError, as Python users expect; `param` holds the
parameter's name (as SamplingParams, BeamSearchParams or the prompt spell it),
so a server can report it without parsing the message.
"""

from __future__ import annotations


class InvalidParameter(ValueError):
    """A request parameter whose value is outside its limits."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class InvalidParameterType(TypeError):
    """A request parameter of the wrong type."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
