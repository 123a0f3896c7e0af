"""``--config FILE``: flags read from a YAML file, as ``vllm serve --config`` reads them.

The file's keys are the long flag names (``max-num-seqs``; ``max_num_seqs`` too), its
values what the flag takes: a scalar, a list for a flag of several values, true/false for
a switch, a mapping for a JSON flag. A flag on the command line wins over the file, and
the file over the defaults. An unknown key, or a value of the wrong shape, is refused by
name.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

CONFIG_FLAG = "--config"


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(CONFIG_FLAG, default=None, metavar="FILE",
                        help="read flags from a YAML file whose keys are the long flag names "
                        "(vLLM's config.yaml); flags on the command line win")


def config_path(argv: list[str]) -> str | None:
    """The value of the last ``--config`` in ``argv``, if any."""
    path = None
    for i, arg in enumerate(argv):
        if arg == CONFIG_FLAG:
            if i + 1 >= len(argv):
                raise ValueError(f"{CONFIG_FLAG}: expected a file")
            path = argv[i + 1]
        elif arg.startswith(CONFIG_FLAG + "="):
            path = arg.split("=", 1)[1]
    return path


def load_config(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"{CONFIG_FLAG} {path}: cannot read it ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{CONFIG_FLAG} {path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{CONFIG_FLAG} {path}: expected a mapping of flag names to values, "
                         f"got {type(data).__name__}")
    return data


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> set[str]:
    """Make the file's values ``parser``'s defaults, checked and converted by the flags
    themselves (types, choices); returns the destinations the file set."""
    options = {opt: action for action in parser._actions for opt in action.option_strings}
    tokens: list[str] = []
    dests: set[str] = set()
    for key, value in load_config(path).items():
        flag = "--" + str(key).replace("_", "-")
        action = options.get(flag)
        if action is None or flag == CONFIG_FLAG or action.dest == "help":
            raise ValueError(f"{CONFIG_FLAG} {path}: unknown key {key!r} (no flag {flag})")
        tokens += _tokens(flag, action, value, f"{CONFIG_FLAG} {path}: key {key!r}")
        dests.add(action.dest)
    namespace = _parse_alone(parser, tokens, path)
    parser.set_defaults(**{dest: getattr(namespace, dest) for dest in dests})
    return dests


def _tokens(flag: str, action: argparse.Action, value: Any, where: str) -> list[str]:
    if action.nargs == 0:  # a switch: store_true, store_const, --x/--no-x
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        if value:
            return [flag]
        if isinstance(action, argparse.BooleanOptionalAction):
            return ["--no-" + flag[2:]]
        return []  # a store_true switch left off
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    if isinstance(value, list):
        if action.nargs not in ("+", "*") and not isinstance(action.nargs, int):
            raise ValueError(f"{where}: takes one value, got a list")
        return [flag, *(_scalar(v, where) for v in value)]
    return [flag, _scalar(value, where)]


def _scalar(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return str(value)
    raise ValueError(f"{where}: expected a number, a string or a list of them, "
                     f"got {type(value).__name__}")


class _ConfigError(Exception):
    pass


def _parse_alone(parser: argparse.ArgumentParser, tokens: list[str],
                 path: str) -> argparse.Namespace:
    """Parse the file's flags on their own; argparse's complaints become ValueErrors."""
    def error(message: str) -> None:
        raise _ConfigError(message)

    saved = parser.error
    parser.error = error  # type: ignore[method-assign]
    try:
        namespace, extra = parser.parse_known_args(tokens, argparse.Namespace())
    except _ConfigError as e:
        raise ValueError(f"{CONFIG_FLAG} {path}: {e}") from None
    finally:
        parser.error = saved  # type: ignore[method-assign]
    if extra:
        raise ValueError(f"{CONFIG_FLAG} {path}: could not read {' '.join(extra)}")
    return namespace
