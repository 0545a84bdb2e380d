"""Which engine fields the user set: each engine flag's action records its field on the parsed namespace,
and the keys of a --config file count too. `EngineArgs.from_cli` (fitserve/args.py) reads them; auto-fit
fills only the others."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

import yaml

# Set on a parsed namespace by the engine flags' actions: the EngineArgs fields given on the command line.
EXPLICIT_FLAGS_DEST = "explicit_engine_flags"


def record_explicit_flags(parser: argparse.ArgumentParser, names: frozenset[str]) -> None:
    """Makes each engine flag record its field in the namespace when it appears on the command line."""
    parser.set_defaults(**{EXPLICIT_FLAGS_DEST: frozenset()})
    for action in parser._actions:
        if action.option_strings and action.dest in names:
            action.__class__ = _recording(type(action))


@functools.cache
def _recording(action_class: type[argparse.Action]) -> type[argparse.Action]:
    def __call__(
        self: argparse.Action, parser: Any, namespace: Any, values: Any, option_string: Any = None
    ) -> None:
        action_class.__call__(self, parser, namespace, values, option_string)
        given = getattr(namespace, EXPLICIT_FLAGS_DEST, frozenset())
        setattr(namespace, EXPLICIT_FLAGS_DEST, frozenset(given) | {self.dest})

    return type(f"Recording{action_class.__name__}", (action_class,), {"__call__": __call__})


def explicit_engine_fields(namespace: argparse.Namespace, names: frozenset[str]) -> frozenset[str]:
    """The EngineArgs fields the user set: flags on the command line and keys of the --config file."""
    explicit = set(getattr(namespace, EXPLICIT_FLAGS_DEST, frozenset()))
    return frozenset(explicit | _config_engine_keys(namespace, names).keys())


def config_key_sources(namespace: argparse.Namespace, names: frozenset[str]) -> dict[str, str]:
    """EngineArgs field -> "the 'key' key of --config FILE", for each field the --config file set and
    the command line did not."""
    on_command_line = getattr(namespace, EXPLICIT_FLAGS_DEST, frozenset())
    return {
        name: f"the '{key}' key of --config {namespace.config}"
        for name, key in _config_engine_keys(namespace, names).items()
        if name not in on_command_line
    }


def _config_engine_keys(namespace: argparse.Namespace, names: frozenset[str]) -> dict[str, str]:
    """EngineArgs field -> the key that sets it in the --config file ({} without one)."""
    config = getattr(namespace, "config", None)
    if not config:
        return {}
    content = yaml.safe_load(Path(config).read_text(encoding="utf-8")) or {}
    keys = {str(key).replace("-", "_"): str(key) for key in content}
    return {name: key for name, key in keys.items() if name in names}
