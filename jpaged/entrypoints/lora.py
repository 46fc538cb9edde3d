"""The models a server answers to: its base model and its LoRA adapters (vLLM's).

An adapter comes from `--lora-modules name=path` at start-up or, where the server
allows run-time updates, from `POST /v1/load_lora_adapter`; each gets the next
lora_int_id (1, 2, ...), which it keeps. A request's `model` field names the base model
or an adapter; `/v1/models` lists the adapters with `parent` set to their base model
and `root` to their directory. Unloading takes an adapter off the list: requests that
run with it finish with it, and new ones naming it get 404. Loading reads and checks
the adapter (the engine's PEFT checks) before it is listed, and takes a path only
inside the allowed directory.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from jpaged.entrypoints.errors import ApiError
from jpaged.lora.request import LoRARequest


@dataclass(frozen=True)
class LoRAModule:
    """An adapter to serve: the name requests give as `model`, its PEFT directory, and
    the model it was trained on (None: the server's base model)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """A `--lora-modules` entry: `name=path`, or vLLM's JSON {"name": ..., "path": ...,
    "base_model_name": ...}; ValueError naming what is wrong."""
    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{text!r} is not valid JSON ({error})") from None
        unknown = set(fields) - {"name", "path", "base_model_name"}
        if unknown or not all(isinstance(fields.get(key), str) and fields[key]
                              for key in ("name", "path")):
            raise ValueError(f"{text!r}: give a JSON object with strings "
                             "'name' and 'path' and optionally 'base_model_name'")
        return LoRAModule(fields["name"], fields["path"], fields.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"{text!r}: give name=path (or vLLM's JSON form)")
    return LoRAModule(name, path)


def module_requests(modules: Sequence[LoRAModule]) -> list[LoRARequest]:
    """The LoRARequest of each module: lora_int_id 1, 2, ... in the order given."""
    return [LoRARequest(module.name, int_id, module.path)
            for int_id, module in enumerate(modules, 1)]


class ServedModels:
    """The base model's name and the adapters served, by name.

    runtime_updates: the load and unload endpoints answer (else 404, as in vLLM);
    allowed_dir: the directory adapters loaded at run time must lie in.
    """

    def __init__(self, base_name: str, base_root: str, max_model_len: int,
                 modules: Sequence[LoRAModule] = (), runtime_updates: bool = False,
                 allowed_dir: str | None = None):
        if runtime_updates and allowed_dir is None:
            raise ValueError("run-time LoRA updating needs an allowed directory "
                             "(--lora-allowed-dir DIR): adapters load only from inside it")
        self.base_name, self.base_root, self.max_model_len = base_name, base_root, max_model_len
        self.runtime_updates = runtime_updates
        self.allowed_dir = None if allowed_dir is None else Path(allowed_dir).resolve()
        self._int_ids = itertools.count(len(modules) + 1)  # run-time loads' ids
        self.adapters: dict[str, tuple[LoRARequest, str]] = {}  # name -> (request, parent)
        for module, request in zip(modules, module_requests(modules), strict=True):
            if self._taken(module.name):
                raise ValueError(f"--lora-modules: the name {module.name!r} is taken (names "
                                 "differ from each other and from the base model's)")
            self._add(request, module.base_model_name)

    def _taken(self, name: str) -> bool:
        return name == self.base_name or name in self.adapters

    def _add(self, request: LoRARequest, parent: str | None) -> None:
        self.adapters[request.lora_name] = (request, parent or self.base_name)

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for a name
        the server does not serve."""
        if model is None or model == self.base_name:
            return None
        if model not in self.adapters:
            raise ApiError(404, f"The model `{model}` does not exist. This server serves "
                                f"{self.names()}", "model")
        return self.adapters[model][0]

    def names(self) -> list[str]:
        return [self.base_name, *self.adapters]

    def cards(self) -> list[dict]:
        """/v1/models' entries: the base model, then each adapter."""
        created = int(time.time())
        base = {"id": self.base_name, "object": "model", "created": created,
                "owned_by": "jpaged", "root": self.base_root, "parent": None,
                "max_model_len": self.max_model_len}
        return [base, *({"id": name, "object": "model", "created": created,
                         "owned_by": "jpaged", "root": request.lora_path, "parent": parent}
                        for name, (request, parent) in self.adapters.items())]

    def card(self, model_id: str) -> dict:
        """GET /v1/models/{model_id}: its card, or 404."""
        self.lora_request(model_id)
        return next(card for card in self.cards() if card["id"] == model_id)

    # Run-time updates.

    def check_updates_allowed(self) -> None:
        if not self.runtime_updates:
            raise ApiError(404, "loading and unloading LoRA adapters at run time is off; "
                                "start the server with --enable-runtime-lora-updating")

    def adapter_path(self, lora_path: str) -> str:
        """`lora_path` resolved (a relative one inside the allowed directory); 400 for a
        path outside the allowed directory."""
        path = (self.allowed_dir / lora_path).resolve()
        if not path.is_relative_to(self.allowed_dir):
            raise ApiError(400, f"lora_path {lora_path!r} is outside the allowed directory "
                                f"{self.allowed_dir} (--lora-allowed-dir)", "lora_path")
        return str(path)

    def begin_load(self, lora_name: str, lora_path: str) -> LoRARequest:
        """The LoRARequest of an adapter to load, with the next lora_int_id, not listed
        yet: 400 for a taken name or a path outside the allowed directory."""
        self._check_free(lora_name)
        return LoRARequest(lora_name, next(self._int_ids), self.adapter_path(lora_path))

    def finish_load(self, request: LoRARequest) -> None:
        """List an adapter whose check passed (400 if a load of its name won meanwhile)."""
        self._check_free(request.lora_name)
        self._add(request, None)

    def _check_free(self, lora_name: str) -> None:
        if self._taken(lora_name):
            raise ApiError(400, f"The lora adapter '{lora_name}' has already been loaded "
                                "(unload it first, or choose another name)", "lora_name")

    def unload(self, lora_name: str | None, lora_int_id: int | None) -> str:
        """Take the adapter named `lora_name` (or of `lora_int_id`) off the list: 404 for
        one not listed. Its name."""
        for name, (request, _) in self.adapters.items():
            if (lora_name in (None, name)) and (lora_int_id in (None, request.lora_int_id)):
                del self.adapters[name]
                return name
        raise ApiError(404, f"The lora adapter '{lora_name or lora_int_id}' cannot be found",
                       "lora_name")
