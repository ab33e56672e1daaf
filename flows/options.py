"""One definition of every command line: flags built from the settings models' own fields.

Each entry point lists the fields it exposes (``Flag``): the flag's name,
type, choices, default and help all come from the pydantic field (its
``description`` is the help text, with the environment variable that sets
it), so a flag can never drift from the setting it sets. ``given`` turns the
parsed arguments back into the nested keyword arguments of the model —
only what was given on the command line; the environment fills in the rest
when the model is built.
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel


@dataclass(frozen=True)
class Flag:
    """A field of a settings model exposed as a flag; ``path`` may reach into a nested model ("a.b")."""

    path: str
    name: str | None = None  # default: --field-name
    invert: bool = False  # a boolean field that defaults to True, given as --no-...
    required: bool = False

    @property
    def dest(self) -> str:
        return self.path.replace(".", "__")

    def option(self) -> str:
        if self.name:
            return self.name
        leaf = self.path.rsplit(".", 1)[-1].replace("_", "-")
        return f"--no-{leaf}" if self.invert else f"--{leaf}"


def _field(model: type[BaseModel], path: str):
    """(the model that owns the field, the field's name, its FieldInfo)."""
    owner, *rest = path.split(".")
    info = model.model_fields[owner]
    if not rest:
        return model, owner, info
    return _field(_model_of(info.annotation), ".".join(rest))


def _model_of(annotation) -> type[BaseModel]:
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    raise TypeError(f"{annotation} is not a settings model")


def _plain(annotation):
    """The annotation without ``None`` in a union."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def env_name(model: type[BaseModel], name: str) -> str | None:
    prefix = (getattr(model, "model_config", {}) or {}).get("env_prefix")
    return f"{prefix}{name}".upper() if prefix is not None else None


def help_text(model: type[BaseModel], path: str) -> str:
    owner, name, info = _field(model, path)
    text = info.description or name.replace("_", " ")
    env = env_name(owner, name)
    from pydantic_core import PydanticUndefined

    default = None if info.is_required() else info.get_default(call_default_factory=False)
    if default is not PydanticUndefined and default not in (None, ..., [], {}) and not isinstance(default, bool):
        text += f" (default: {default})"
    return f"{text} [{env}]" if env else text


def add_flags(parser: argparse.ArgumentParser | Any, model: type[BaseModel], flags: list[Flag]) -> None:
    """Add one option per ``Flag`` to ``parser``, typed and documented by the model's field."""
    for flag in flags:
        _, _, info = _field(model, flag.path)
        annotation = _plain(info.annotation)
        text = help_text(model, flag.path)
        kwargs: dict[str, Any] = {"dest": flag.dest, "help": f"don't {text}" if flag.invert else text,
                                  "default": None,
                                  "metavar": flag.path.rsplit(".", 1)[-1].upper()}
        if annotation is bool:
            kwargs.pop("metavar")
            kwargs["action"] = "store_const"
            kwargs["const"] = not flag.invert
        elif typing.get_origin(annotation) is Literal:
            kwargs.pop("metavar")
            kwargs["choices"] = list(typing.get_args(annotation))
        elif typing.get_origin(annotation) in (list, tuple):
            kwargs["action"] = "append"
            kwargs["metavar"] = flag.path.rsplit(".", 1)[-1].rstrip("s").upper()
            kwargs["help"] += " (repeat the flag for each)"
        elif annotation in (int, float):
            kwargs["type"] = annotation
        elif annotation in (str, Path):
            kwargs["type"] = str
        if flag.required:
            kwargs["required"] = True
        parser.add_argument(flag.option(), **kwargs)


def given(args: argparse.Namespace, flags: list[Flag]) -> dict:
    """The nested keyword arguments the given flags set (flags left out are absent, not None)."""
    out: dict = {}
    for flag in flags:
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        node = out
        *parents, leaf = flag.path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def build(model: type[BaseModel], values: dict):
    """``model(**values)``, building nested settings through their own constructors (so they read their
    environment too, for whatever the flags left out)."""
    kwargs = dict(values)
    for name, value in values.items():
        if isinstance(value, dict) and name in model.model_fields:
            kwargs[name] = build(_model_of(model.model_fields[name].annotation), value)
    return model(**kwargs)
