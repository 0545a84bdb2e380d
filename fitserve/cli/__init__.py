"""The `fitserve` command (main.py): serve, generate (generate.py), plan and doctor (plan.py, doctor.py),
and bench (fitserve/bench/cli_bench.py)."""

from fitserve.cli.main import main

__all__ = ["main"]
