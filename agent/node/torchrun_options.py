"""torchrun's argument parser, rebuilt from a description so that a launch imports no torch.

Fitting a torchrun command to the job (:func:`agent.node.launch.fit_torchrun`)
parses it with torchrun's own parser, ``torch.distributed.run.get_args_parser()``:
its options, abbreviations and ``PET_*`` defaults are torch's, whatever the
version. Importing it imports torch, over a second of CPU on every node at
every launch, on the path from a fault to the first resumed step, right
before torchrun imports torch again. So the first launch describes the parser
as data (each option's strings, destination, arity, type, default, choices,
and whether it reads ``PET_*``), and stores the description beside the job's
secret; every later launch on any node rebuilds an equivalent parser from it
without importing torch. The description is keyed by torch's version and
location (read without importing it): a job whose torch changed describes it
again. With warm pools the first launch does not import it either: each node's
pool, which imported torch anyway, describes it as soon as it is warm, and the
agents wait for that (:mod:`agent.node.warmpool`).

Anything the description cannot hold exactly (an action or type it does not
know, a ``PET_*`` variable set while describing, which would hide the default)
is not stored, and such a launch keeps using torch's parser: slower, never
different. ``tests/unit/agent/node/test_torchrun_options.py`` holds the rebuilt parser to
torch's own on the command lines Resurgo fits.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# Bumped when the description's format changes: an older one is described again.
FORMAT = 1
_PREFIX = "torchrun-options-"


def _comma_separated_list(value: str) -> list[str]:
    """torchrun's ``comma_separated_list`` (``,,`` stands for a comma)."""
    placeholder = "<COMMA_PLACEHOLDER>"
    return [item.replace(placeholder, ",") for item in value.replace(",,", placeholder).split(",")]


_TYPES: dict[str, Callable[[str], Any]] = {
    "str": str,
    "int": int,
    "float": float,
    "comma_separated_list": _comma_separated_list,
}


class _Env(argparse.Action):
    """torch's ``env`` action: the default comes from ``PET_<DEST>`` when it is set."""

    def __init__(
        self, option_strings: list[str], dest: str, default: Any = None, required: bool = False,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        default = os.environ.get(f"PET_{dest.upper()}", default)
        if default:
            required = False
        super().__init__(option_strings, dest, default=default, required=required, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, values)


class _CheckEnv(argparse.Action):
    """torch's ``check_env`` action: a flag that ``PET_<DEST>=1`` also sets."""

    def __init__(
        self, option_strings: list[str], dest: str, default: bool = False, **kwargs: Any
    ) -> None:
        default = bool(int(os.environ.get(f"PET_{dest.upper()}", "1" if default else "0")))
        super().__init__(option_strings, dest, const=True, default=default, nargs=0, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, self.const)


_KINDS: dict[str, type[argparse.Action] | str] = {
    "env": _Env,
    "check_env": _CheckEnv,
    "_StoreAction": "store",
    "_HelpAction": "help",
}


class Undescribable(ValueError):
    """The parser holds something the description cannot reproduce exactly."""


def describe(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> dict[str, Any]:
    """``parser`` as JSON-able data; :class:`Undescribable` when it cannot be exact."""
    if parser._mutually_exclusive_groups:
        raise Undescribable("mutually exclusive groups")
    actions = []
    for action in parser._actions:
        kind = type(action).__name__
        if kind not in _KINDS:
            raise Undescribable(f"action {kind} of {action.dest}")
        if kind in ("env", "check_env") and f"PET_{action.dest.upper()}" in environ:
            raise Undescribable(f"PET_{action.dest.upper()} is set: its default is hidden")
        type_name = None
        if action.type is not None:
            type_name = getattr(action.type, "__name__", "")
            if _TYPES.get(type_name) is not action.type and type_name != "comma_separated_list":
                raise Undescribable(f"type {type_name!r} of {action.dest}")
        default = action.default
        if kind != "_HelpAction":
            json.dumps(default)  # TypeError: not data
        actions.append(
            {
                "kind": kind,
                "option_strings": list(action.option_strings),
                "dest": action.dest,
                "nargs": action.nargs,
                "default": default,
                "type": type_name,
                "choices": None if action.choices is None else list(action.choices),
                "required": action.required,
            }
        )
    return {
        "format": FORMAT,
        "allow_abbrev": parser.allow_abbrev,
        "prefix_chars": parser.prefix_chars,
        "actions": actions,
    }


def rebuild(description: Mapping[str, Any]) -> argparse.ArgumentParser:
    """The parser ``description`` describes (``PET_*`` read now, as torch's reads them)."""
    if description.get("format") != FORMAT:
        raise Undescribable(f"format {description.get('format')!r}, not {FORMAT}")
    parser = argparse.ArgumentParser(
        prog="torchrun",
        add_help=False,
        allow_abbrev=bool(description["allow_abbrev"]),
        prefix_chars=str(description["prefix_chars"]),
    )
    for spec in description["actions"]:
        kind = _KINDS[spec["kind"]]
        strings = spec["option_strings"]
        if kind == "help":
            parser.add_argument(*strings, action="help", help=argparse.SUPPRESS)
            continue
        options: dict[str, Any] = {"action": kind, "default": spec["default"]}
        if kind is not _CheckEnv:
            options["nargs"] = spec["nargs"]
            if spec["type"] is not None:
                options["type"] = _TYPES[spec["type"]]
            if spec["choices"] is not None:
                options["choices"] = spec["choices"]
        if strings:
            options["dest"] = spec["dest"]
            options["required"] = spec["required"]
            parser.add_argument(*strings, **options)
        else:
            parser.add_argument(spec["dest"], **options)
    return parser


def torch_key() -> str | None:
    """torch's version and location, found without importing it (None: no torch)."""
    try:
        spec = importlib.util.find_spec("torch")
        version = importlib.metadata.version("torch")
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return None
    if spec is None or spec.origin is None:
        return None
    where = hashlib.sha256(spec.origin.encode()).hexdigest()[:16]
    return f"{version}-{where}-f{FORMAT}".replace(os.sep, "_")


def description_path(cache_dir: Path) -> Path | None:
    """Where ``cache_dir`` holds the description for this torch (None: no torch)."""
    key = torch_key()
    return None if key is None else cache_dir / f"{_PREFIX}{key}.json"


def torchrun_parser(cache_dir: Path | None = None) -> argparse.ArgumentParser:
    """torchrun's parser: rebuilt from ``cache_dir``'s description when there is one for
    this torch, else torch's own (described into ``cache_dir`` for the next launch)."""
    path = None if cache_dir is None else description_path(cache_dir)
    if path is not None:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            return rebuild(json.loads(path.read_text()))
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    if path is not None:
        with contextlib.suppress(OSError, ValueError, TypeError):
            _write(path, describe(parser, os.environ))
    return parser


def _write(path: Path, description: Mapping[str, Any]) -> None:
    """Atomically: agents on several nodes may describe it at once."""
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(description, out)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
