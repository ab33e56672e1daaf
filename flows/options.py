"""One definition of every command line: flags built from the settings models' own fields.

A field's flag is defined once, on the field: its name is ``--field-name``
unless the field says otherwise (``json_schema_extra={"flag": "--lock-timeout"}``,
see ``flag_of``); a nested model's fields get flags only where the field that
holds it names them (``json_schema_extra={"flags": {"concurrency": "--fetch-workers"}}``:
the same setting may be spelled differently by the receiver and the publisher).
The flag's type, choices, default and help all come from the pydantic field
(its ``description`` is the help text, with the environment variable that
sets it); a boolean that defaults to True is given as ``--no-...``. An entry
point only chooses which fields it exposes (``flags``).

``given`` turns the parsed arguments back into the nested keyword arguments
of the model — only what was given on the command line; the environment
fills in the rest when the model is built. Below the command line errors
name fields (``catalog``, ``kind``); ``field_errors`` and ``as_flags`` are the
one place a field becomes a flag again, for the user of a command.
"""

from __future__ import annotations

import argparse
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal

from pydantic import BaseModel


@dataclass(frozen=True)
class Flag:
    """A field of a settings model exposed as a flag; ``path`` may reach into a nested model ("a.b")."""

    path: str
    name: str | None = None  # default: --field-name
    invert: bool = False  # a boolean field that defaults to True, given as --no-...
    required: bool = False
    takes_value: bool = True  # False for a boolean: the flag alone sets it

    @property
    def dest(self) -> str:
        return self.path.replace(".", "__")

    @property
    def field(self) -> str:
        """The keyword that sets it (the leaf field's name)."""
        return self.path.rsplit(".", 1)[-1]

    def option(self) -> str:
        if self.name:
            return self.name
        leaf = self.field.replace("_", "-")
        return f"--no-{leaf}" if self.invert else f"--{leaf}"


def _extra(info) -> dict:
    extra = info.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def flag_of(model: type[BaseModel], path: str) -> Flag:
    """The flag of one field, as the model defines it (a nested field's: as its holder names it)."""
    head, _, leaf = path.rpartition(".")
    _, name, info = _field(model, path)
    spelled = _extra(info).get("flag")
    if head:
        holder = _field(model, head)[2]
        spelled = _extra(holder).get("flags", {}).get(leaf) or spelled
    default = None if info.is_required() else info.get_default(call_default_factory=False)
    boolean = _plain(info.annotation) is bool
    return Flag(path, spelled, invert=boolean and default is True, takes_value=not boolean)


def flags(model: type[BaseModel], *paths: str, exclude: Iterable[str] = ()) -> list[Flag]:
    """The flags of ``paths``; with none, of every field the model exposes: its own fields (a nested model's
    only where its holder names them), in the model's order, less ``exclude``."""
    if not paths:
        found = []
        for name, info in model.model_fields.items():
            nested = _extra(info).get("flags")
            if nested is not None:
                found += [f"{name}.{leaf}" for leaf in nested]
            elif not _is_model(info.annotation):
                found.append(name)
        paths = tuple(found)
    excluded = set(exclude)
    return [flag_of(model, path) for path in paths if path not in excluded]


def _is_model(annotation) -> bool:
    try:
        _model_of(annotation)
    except TypeError:
        return False
    return True


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
    from pydantic import ValidationError

    kwargs = dict(values)
    for name, value in values.items():
        if isinstance(value, dict) and name in model.model_fields:
            try:
                kwargs[name] = build(_model_of(model.model_fields[name].annotation), value)
            except ValidationError as exc:  # located in the model that holds it, as one model's error would be
                raise ValidationError.from_exception_data(exc.title, [
                    {"type": e["type"], "loc": (name, *e["loc"]), "input": e["input"],
                     **({"ctx": e["ctx"]} if "ctx" in e else {})} for e in exc.errors()]) from None
    return model(**kwargs)


def field_errors(exc, flag_list: list[Flag]) -> str:
    """A pydantic ``ValidationError`` for the user of a command: each error's field rendered as its flag
    (``--catalog: ...``), a model's own check as ``value``; the messages themselves name fields."""
    options = {f.path: f.option() for f in flag_list}
    parts = []
    for error in exc.errors():
        path = ".".join(map(str, error["loc"]))
        parts.append(f"{options.get(path, path) or 'value'}: {as_flags(error['msg'], flag_list)}")
    return "; ".join(parts)


def error_as_flags(exc, flag_list: list[Flag]) -> str:
    """A ``RefitError`` for the user of a command: its message and its ``field`` context as flags."""
    import copy

    shown = copy.copy(exc)
    shown.reason = as_flags(exc.reason, flag_list)
    by_field = {f.field: f.option() for f in flag_list}
    shown.field = by_field.get(exc.field, exc.field) if exc.field else exc.field
    return shown._render()


def as_flags(text: str, flag_list: list[Flag]) -> str:
    """A message that names keywords (``base_checkpoint=``, ``kind="full"``) as the command line's flags
    (``--base-checkpoint``, ``--kind full``): the one place below which errors speak in fields."""
    options = {f.field: f for f in flag_list}
    if not options:
        return text

    def render(match: re.Match) -> str:
        option = options[match.group(1)]
        value, literal = match.group(2), match.group(3)
        if literal is not None and (literal == "True") == option.invert:  # not what the flag sets: as written
            return match.group(0)
        if value is None or not option.takes_value:  # a boolean's flag alone (``=True``: the flag sets it)
            return option.option()
        return f"{option.option()} {value}"

    names = "|".join(sorted(map(re.escape, options), key=len, reverse=True))
    return re.sub(rf"(?<![\w.-])({names})=(?:\"([^\"]*)\"|(True|False)\b)?", render, text)


def parse(parser: argparse.ArgumentParser, model: type[BaseModel], flag_list: list[Flag], argv: list[str]):
    """(``model`` from the flags given in ``argv`` and the environment, the parsed arguments); an invalid value
    is a usage error naming its flag (exit 2)."""
    from pydantic import ValidationError

    args = parser.parse_args(with_values(argv, flag_list))
    try:
        return build(model, given(args, flag_list)), args
    except ValidationError as exc:
        parser.error(field_errors(exc, flag_list))


def with_values(argv: list[str], flag_list: list[Flag]) -> list[str]:
    """``argv`` with each value-taking flag joined to the word after it (``--name-suffix -gpu3`` as
    ``--name-suffix=-gpu3``): a flag that takes a value takes the next word, even one that starts with a dash
    (argparse would read ``-gpu3`` as an unknown flag); a word that starts with ``--``, or ``-h``, is a flag."""
    takes = {f.option() for f in flag_list if f.takes_value}
    out: list[str] = []
    words = iter(argv)
    for word in words:
        if word in takes:
            value = next(words, None)
            if value is not None and value.startswith("-") and not value.startswith("--") and value != "-h":
                out.append(f"{word}={value}")
                continue
            out.append(word)
            if value is not None:
                out.append(value)
        else:
            out.append(word)
    return out
