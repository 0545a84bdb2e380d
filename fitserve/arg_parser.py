"""The command-line parser behind every fitserve subcommand, and YAML config files (`--config FILE`).

A YAML file's keys are the flag names (dashes or underscores); each key and value is checked against the
parser's own options, engine and server alike, then set as the parser's defaults, so flags given on the
command line win over the file. A command that runs the engine without the server (`fitserve generate`,
`fitserve bench throughput|latency`) skips a serve config's server keys (host, port, api-key, ...) with
one log line naming them; a key no fitserve command knows is refused with the closest valid name.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any, NoReturn

import yaml

logger = logging.getLogger("fitserve")

# Options that a YAML file cannot set.
NOT_YAML_KEYS = ("help", "config")


def nullable_str(value: str) -> str | None:
    """A string flag where "" or "None" means unset, as in vLLM."""
    return None if value in ("", "None") else value


def json_object(value: str | dict) -> dict:
    """A flag holding a JSON object; YAML files may give the mapping itself."""
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{value!r} is not valid JSON ({error})") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"{value!r} is not a JSON object: write it as '{{\"key\": value}}'")
    return parsed


class FlexibleArgumentParser(argparse.ArgumentParser):
    """argparse that takes --flag_name for --flag-name and names the closest flag on a typo."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        return super().parse_known_args(_dash_flag_names(args), namespace)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self._unrecognized_message(extras))
        return parsed

    def error(self, message: str) -> NoReturn:
        """The message alone: the usage line of ~40 engine flags would bury it."""
        self.exit(2, f"{self.prog}: error: {message}\n")

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        """argparse's check of a flag's choices, naming the closest choice on a typo."""
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as error:
            choices = [str(choice) for choice in action.choices or ()]
            close = difflib.get_close_matches(str(value), choices, n=1)
            if not close:
                raise
            raise argparse.ArgumentError(action, f"{error.message} (did you mean {close[0]}?)") from None

    def option_actions(self) -> list[argparse.Action]:
        """The actions behind --flags (argparse keeps them in a private list)."""
        return [action for action in self._actions if action.option_strings]

    def _unrecognized_message(self, extras: list[str]) -> str:
        known = [name for action in self.option_actions() for name in action.option_strings]
        parts = []
        for token in extras:
            name = token.split("=", 1)[0]
            close = difflib.get_close_matches(name, known, n=1) if name.startswith("-") else []
            hint = f" (did you mean {close[0]}?)" if close else ""
            parts.append(f"{token}{hint}")
        return f"unrecognized arguments: {', '.join(parts)}; see {self.prog} --help"


def _dash_flag_names(args: Sequence[str] | None) -> list[str] | None:
    """--max_model_len=5 -> --max-model-len=5; values and everything after a bare "--" stay as given."""
    if args is None:
        return None
    result: list[str] = []
    for index, token in enumerate(args):
        if token == "--":
            return result + list(args[index:])
        if token.startswith("--"):
            name, sep, value = token.partition("=")
            token = "--" + name[2:].replace("_", "-") + sep + value
        result.append(token)
    return result


def parse_args_with_config(
    parser: FlexibleArgumentParser, argv: Sequence[str], server_keys: Collection[str] = ()
) -> argparse.Namespace:
    """Parse argv, taking defaults from the YAML file named by --config; the command line wins.

    `server_keys`: the option names (dests) of `fitserve serve` that this parser lacks; such keys in the
    file are skipped with one log line instead of refused, so a serve config.yaml works here too."""
    finder = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    finder.add_argument("--config", default=None)
    config_path = finder.parse_known_args(_dash_flag_names(argv))[0].config
    if config_path is not None:
        parser.set_defaults(**load_yaml_defaults(parser, config_path, server_keys))
    return parser.parse_args(argv)


def load_yaml_defaults(
    parser: FlexibleArgumentParser, path: str, server_keys: Collection[str] = ()
) -> dict[str, Any]:
    """The YAML file's keys as parser defaults, each key and value checked against the parser's options;
    keys among `server_keys` are left out, named in one log line."""
    try:
        content = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        parser.error(f"cannot read --config {path}: {error.strerror}")
    except yaml.YAMLError as error:
        parser.error(f"--config {path} is not valid YAML: {error}")
    if content is None:
        return {}
    if not isinstance(content, dict):
        parser.error(
            f"--config {path} must be a mapping of flag names to values, found {type(content).__name__}"
        )
    actions = {a.dest: a for a in parser.option_actions() if a.dest not in NOT_YAML_KEYS}
    defaults: dict[str, Any] = {}
    skipped: list[str] = []
    for key, value in content.items():
        dest = str(key).replace("-", "_")
        if dest not in actions and dest in server_keys:
            skipped.append(str(key))
            continue
        if dest not in actions:
            names = [_dashed(d) for d in (*actions, *server_keys)]
            close = difflib.get_close_matches(_dashed(dest), names, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else "; see --help for the valid names"
            parser.error(f"unknown key '{key}' in --config {path}{hint}")
        try:
            defaults[dest] = _yaml_value(actions[dest], value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as error:
            parser.error(f"key '{key}' in --config {path}: {error}")
    if skipped:
        logger.info(
            "Ignoring server settings in %s that %s does not use: %s", path, parser.prog, ", ".join(skipped)
        )
    return defaults


def _yaml_value(action: argparse.Action, value: Any) -> Any:
    """A YAML value converted as the flag would convert it on the command line."""
    if action.nargs == 0:  # a switch: true gives the flag, false leaves it off
        if not isinstance(value, bool):
            raise ValueError(f"{value!r} is not true or false")
        if isinstance(action, argparse.BooleanOptionalAction):
            return value
        return action.const if value else action.default
    if value is None:
        if action.default is not None:
            raise ValueError(
                f"null is not allowed here: give a value or leave the key out (default {action.default})"
            )
        return None
    takes_list = action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction)
    if takes_list:
        return [_yaml_scalar(action, item) for item in (value if isinstance(value, list) else [value])]
    return _yaml_scalar(action, value)


def _yaml_scalar(action: argparse.Action, value: Any) -> Any:
    convert = action.type
    if convert is json_object:
        converted = json_object(value)
    elif isinstance(value, dict | list):
        raise ValueError(f"{value!r} is a {type(value).__name__}, expected a single value")
    elif callable(convert):
        type_name = getattr(convert, "__name__", "value")
        if isinstance(value, bool) and convert in (int, float):
            raise ValueError(f"{value!r} is not a valid {type_name}")
        try:
            converted = convert(value if isinstance(value, str) else str(value))
        except (TypeError, ValueError):
            raise ValueError(f"{value!r} is not a valid {type_name}") from None
    else:
        converted = str(value)
    if action.choices is not None and converted not in action.choices:
        raise ValueError(f"{converted!r} is not one of {', '.join(map(str, action.choices))}")
    return converted


def _dashed(name: str) -> str:
    return name.replace("_", "-")
