"""What every `fitserve` subcommand that runs or plans the engine shares: the MODEL positional."""

from __future__ import annotations

import argparse


def add_model_positional(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="The model, as `vllm serve MODEL`; wins over --model.",
    )
