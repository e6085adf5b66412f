"""Layered settings for Resurgo's daemons: a frozen dataclass from TOML, environment, flags.

One rule for every daemon (the node agent, the supervisor, its policy): a
field can be set in a TOML file (keys as the field names), in the
environment as ``<PREFIX><FIELD>`` (upper case), or as a flag
``--<flag-prefix><field-with-dashes>``; later sources win. Values are
converted to the type of the field's default (``float``, ``int``, ``str``,
``bool``, or an :class:`enum.Enum` by value), and a value that does not
convert, or a TOML key that names no field, is a :class:`ConfigError`
naming the setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import inspect
import math
import re
import reprlib
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from agent import __version__
from agent.wire.errors import ConfigError
from agent.wire.protocol.constants import PROTOCOL_VERSION

_T = TypeVar("_T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def convert(owner: str, name: str, default: Any, value: Any) -> Any:
    """``value`` as the type of ``default``; raises ConfigError naming ``owner`` and ``name``.

    Text (environment, flags) is parsed; a TOML value must already be of a
    fitting kind: no table or array for a single value, no fraction for an
    integer, and no infinite or NaN number anywhere.
    """
    kind = type(default)
    try:
        if isinstance(value, dict | list | tuple):
            pass  # a TOML table or array where one value belongs
        elif isinstance(default, enum.Enum):
            return kind(value.value if isinstance(value, enum.Enum) else value)
        elif kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE | _FALSE:
                return text in _TRUE
        elif kind is float and isinstance(value, str | int | float) and not isinstance(value, bool):
            number = float(value)
            if math.isfinite(number):
                return number
        elif kind is int and isinstance(value, str | int | float) and not isinstance(value, bool):
            if not isinstance(value, float) or value.is_integer():
                return int(value)
        elif kind is str and isinstance(value, str | int) and not isinstance(value, bool):
            return str(value)
    # OverflowError: a float or an integer too large for a double.
    except (TypeError, ValueError, OverflowError):
        pass
    expected = (
        f"one of {', '.join(repr(m.value) for m in kind)}"
        if isinstance(default, enum.Enum)
        else "a float (finite)"
        if kind is float
        else f"a {kind.__name__}"
    )
    raise ConfigError(f"{owner} setting {name} must be {expected}, got {_show(value)}")


def _show(value: Any) -> str:
    """``value`` for an error message, cut short (a TOML array can be long or deep)."""
    text = reprlib.repr(value)
    return text if len(text) <= 200 else f"{text[:200]}..."


def plain_text(text: str) -> str:
    """``text`` without reStructuredText markup, as ``--help`` shows it: a role
    (:mod:`a.b`, :func:`~a.b`) becomes its target, double backquotes go."""
    return _ROLE.sub(_role_target, text).replace("``", "")


def _role_target(role: re.Match[str]) -> str:
    """What Sphinx shows of a role: its target, only the last part after ``~``."""
    target = role.group(1)
    return target.rpartition(".")[2] if target.startswith("~") else target


_ROLE = re.compile(r":[\w:]+:`([^`]+)`")


def field_help(cls: type) -> dict[str, str]:
    """Each field's sentence from its bullet in ``cls``'s docstring, as plain text.

    A bullet is ``- ``name``: text``, continued by indented lines: the docstring
    is the one place a setting is described, and ``--help`` shows it. So that
    every flag's help says what that flag sets, and says its default once, the
    docstring must give every field a bullet of its own (no ``- ``a`` / ``b``:``
    bullet shared by two), no two fields the same sentence, and no sentence the
    word "default" (:func:`add_flags` appends the default); a ValueError names
    the first field that breaks a rule.
    """
    found: dict[str, str] = {}
    names: list[str] = []
    text: list[str] = []

    def flush() -> None:
        if len(names) > 1:
            raise ValueError(
                f"{cls.__name__}'s docstring describes {' and '.join(names)} in one bullet: "
                "give each its own, so that each flag's --help says what it sets"
            )
        if names:
            found[names[0]] = " ".join(plain_text(" ".join(text)).split())

    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        bullet = _BULLET.match(line)
        if bullet:
            flush()
            names = re.findall(r"``(\w+)``", bullet.group(1))
            text = [bullet.group(2)]
        elif names and line.startswith("  ") and line.strip():
            text.append(line)
        else:
            flush()
            names, text = [], []
    flush()
    _check_sentences(cls, found)
    return found


_BULLET = re.compile(r"^- ((?:``\w+``(?: ?/ ?)?)+): (.*)$")


def _check_sentences(cls: type, found: dict[str, str]) -> None:
    """The rules of :func:`field_help` that concern the sentences found."""
    fields = [field.name for field in dataclasses.fields(cls)]
    seen: dict[str, str] = {}
    for name in fields:
        sentence = found.get(name)
        if not sentence:
            raise ValueError(f"{cls.__name__}'s docstring has no bullet for {name}")
        if sentence in seen:
            raise ValueError(
                f"{cls.__name__}'s docstring says the same of {seen[sentence]} and {name}: "
                "say what each sets"
            )
        if re.search(r"\bdefault\b", sentence, re.IGNORECASE):
            raise ValueError(
                f"{cls.__name__}'s bullet for {name} speaks of a default: --help appends the "
                "field's own, and two would disagree"
            )
        seen[sentence] = name
    stale = sorted(set(found) - set(fields))
    if stale:
        raise ValueError(f"{cls.__name__}'s docstring describes no field of it: {stale}")


def show_default(value: Any) -> str:
    """A default as it would be written in TOML or on the command line."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}" if abs(value) < 1e6 else f"{value:.0f}"
    return '""' if value == "" else str(value)


def add_flags(parser: argparse.ArgumentParser, cls: type, flag_prefix: str = "") -> None:
    """Add ``--<flag_prefix><field>`` for every field of dataclass ``cls`` (default None),
    each with its sentence from ``cls``'s docstring (:func:`field_help`, which refuses a
    docstring that would give two flags one text) and then its default, once."""
    described = field_help(cls)
    for field in dataclasses.fields(cls):
        default = field.default
        sentence = described[field.name]
        parser.add_argument(
            f"--{flag_prefix}{field.name.replace('_', '-')}",
            dest=f"{flag_prefix.replace('-', '_')}{field.name}",
            default=None,
            metavar=type(default).__name__.upper() if not isinstance(default, enum.Enum) else None,
            choices=[m.value for m in type(default)] if isinstance(default, enum.Enum) else None,
            # argparse %-formats help: a literal % must be doubled.
            help=f"{sentence} (default: {show_default(default)})".replace("%", "%%"),
        )


def add_version(parser: argparse.ArgumentParser) -> None:
    """``--version``: the program, Resurgo's release and the wire protocol version it
    speaks; agents and a supervisor work together while the protocol versions agree."""
    parser.add_argument(
        "--version",
        action="version",
        version=f"{parser.prog} {__version__} (wire protocol {PROTOCOL_VERSION})",
    )


def read_toml(path: Path, owner: str) -> dict[str, Any]:
    """The TOML document at ``path``; ConfigError when it is missing or malformed."""
    try:
        return tomllib.loads(path.read_text())
    # RecursionError: arrays or tables nested deeper than the parser's stack.
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as error:
        raise ConfigError(f"cannot read {owner} config {path}: {error}") from error


def layered(
    cls: type[_T],
    *,
    owner: str,
    base: Mapping[str, Any] | None = None,
    document: Mapping[str, Any] | None = None,
    source: str = "the config file",
    env_prefix: str,
    environ: Mapping[str, str],
    flags: argparse.Namespace | None = None,
    flag_prefix: str = "",
) -> _T:
    """An instance of dataclass ``cls``: defaults < ``base`` < ``document`` < environment < flags.

    ``base`` holds values found elsewhere (e.g. Slurm's environment);
    ``document`` is the TOML table for ``cls`` (an unknown key is an error
    naming ``source``); ``flags`` a namespace from a parser given
    :func:`add_flags` with the same ``flag_prefix``.
    """
    defaults = {field.name: field.default for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for name, value in (base or {}).items():
        values[name] = convert(owner, name, defaults[name], value)
    for key, value in (document or {}).items():
        if key not in defaults:
            raise ConfigError(f"unknown {owner} setting {key[:100]!r} in {source}")
        values[key] = convert(owner, key, defaults[key], value)
    for name, default in defaults.items():
        variable = env_prefix + name.upper()
        if variable in environ:
            values[name] = convert(owner, name, default, environ[variable])
    if flags is not None:
        dest_prefix = flag_prefix.replace("-", "_")
        for name, default in defaults.items():
            flag = getattr(flags, f"{dest_prefix}{name}", None)
            if flag is not None:
                values[name] = convert(owner, name, default, flag)
    try:
        return cls(**{**defaults, **values})
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{owner} settings: {error}") from error
