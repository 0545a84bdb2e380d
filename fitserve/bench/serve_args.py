"""Flags of `fitserve bench serve`, named and meant as `vllm bench serve`'s, and their checks."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os

from fitserve.bench.client import BACKEND_ENDPOINTS
from fitserve.bench.datasets import (
    DATASET_NAMES,
    DEFAULT_CUSTOM_OUTPUT_LEN,
    DEFAULT_RANDOM_INPUT_LEN,
    DEFAULT_RANDOM_OUTPUT_LEN,
)
from fitserve.bench.metrics import METRIC_NAMES

DEFAULT_NUM_PROMPTS = 1000
DEFAULT_PERCENTILE_METRICS = "ttft,tpot,itl"
DEFAULT_METRIC_PERCENTILES = "99"
# vLLM's client allows a request six hours.
DEFAULT_REQUEST_TIMEOUT_S = 6 * 60 * 60


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("server")
    target.add_argument("--backend", default="openai", choices=list(BACKEND_ENDPOINTS), help="API to call.")
    target.add_argument(
        "--base-url", default=None, help="Server root, e.g. http://10.0.0.2:8000 (wins over --host/--port)."
    )
    target.add_argument("--host", default="127.0.0.1", help="Server host when --base-url is not given.")
    target.add_argument("--port", type=int, default=8000, help="Server port when --base-url is not given.")
    target.add_argument(
        "--endpoint",
        default=None,
        help="API path. Default: /v1/completions for --backend openai, /v1/chat/completions for openai-chat.",
    )
    target.add_argument(
        "--model", default=None, help="Model id to benchmark. Default: the first of /v1/models."
    )
    target.add_argument(
        "--served-model-name", default=None, help="Name sent in the requests. Default: --model."
    )
    target.add_argument(
        "--tokenizer",
        default=None,
        help="Tokenizer for building prompts and counting tokens. Default: --model when it is a local folder "
        "holding a tokenizer, else fitserve's default model's tokenizer (SmolLM2).",
    )
    target.add_argument("--trust-remote-code", action="store_true", help="Allow the tokenizer's own code.")
    target.add_argument(
        "--api-key", default=None, help="Bearer token sent to the server. Default: $OPENAI_API_KEY when set."
    )
    target.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="Seconds one request may take before it counts as a failed (timed-out) request.",
    )

    data = parser.add_argument_group("dataset")
    data.add_argument(
        "--dataset-name", default="random", choices=list(DATASET_NAMES), help="Where prompts come from."
    )
    data.add_argument(
        "--dataset-path", default=None, help='ShareGPT JSON or custom JSONL ({"prompt": ...} lines).'
    )
    data.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS, help="Requests to send.")
    data.add_argument(
        "--random-input-len", type=int, default=DEFAULT_RANDOM_INPUT_LEN, help="Mean prompt tokens."
    )
    data.add_argument(
        "--random-output-len", type=int, default=DEFAULT_RANDOM_OUTPUT_LEN, help="Mean output tokens."
    )
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="Lengths are uniform in [L * (1 - r), L * (1 + r)]; r in [0, 1).",
    )
    data.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="Tokens of one random prefix put before every prompt.",
    )
    data.add_argument("--input-len", type=int, default=None, help="Sets --random-input-len.")
    data.add_argument("--output-len", type=int, default=None, help="Sets every dataset's output length.")
    data.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="Output tokens per ShareGPT prompt. Default: the reply's.",
    )
    data.add_argument(
        "--custom-output-len",
        type=int,
        default=DEFAULT_CUSTOM_OUTPUT_LEN,
        help="Output tokens per custom prompt.",
    )
    data.add_argument(
        "--skip-chat-template",
        action="store_true",
        help="Custom dataset, --backend openai: send prompts as written (default: chat template applied).",
    )

    traffic = parser.add_argument_group("traffic")
    traffic.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Requests per second; inf sends all at once, otherwise Poisson (or gamma) arrivals.",
    )
    traffic.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Gamma shape of the arrival gaps: 1 = Poisson, below 1 burstier, above 1 more even.",
    )
    traffic.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight at once.")
    traffic.add_argument("--seed", type=int, default=0, help="Seed of the prompts and the arrival times.")
    traffic.add_argument(
        "--ignore-eos", action="store_true", help="Send ignore_eos (always on for random prompts)."
    )
    traffic.add_argument(
        "--temperature", type=float, default=None, help="Sent when given; else the server's default."
    )
    traffic.add_argument("--top-p", type=float, default=None, help="Sent when given.")
    traffic.add_argument("--top-k", type=int, default=None, help="Sent when given.")

    report = parser.add_argument_group("report")
    report.add_argument(
        "--percentile-metrics",
        default=DEFAULT_PERCENTILE_METRICS,
        help=f"Comma-separated metrics shown in the table, of {','.join(METRIC_NAMES)}.",
    )
    report.add_argument(
        "--metric-percentiles",
        default=DEFAULT_METRIC_PERCENTILES,
        help="Comma-separated percentiles, e.g. 50,90,99.",
    )
    report.add_argument("--save-result", action="store_true", help="Save the results as JSON.")
    report.add_argument(
        "--save-detailed",
        action="store_true",
        help="Also save per-request lengths, timings, texts and errors.",
    )
    report.add_argument(
        "--result-dir", default=None, help="Folder of the JSON file. Default: the current one."
    )
    report.add_argument(
        "--result-filename",
        default=None,
        help="JSON file name. Default: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json.",
    )
    report.add_argument("--label", default=None, help="Prefix of the default file name. Default: --backend.")
    report.add_argument(
        "--plot",
        nargs="?",
        const="",
        default=None,
        metavar="PNG",
        help="Draw TTFT and E2EL distributions and output tokens/s over time (needs matplotlib). "
        "Default path: the result file's, ending in .png.",
    )
    report.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")


def check_serve_args(args: argparse.Namespace) -> None:
    """Refuse bad values before anything is sent; maps --input-len / --output-len onto the dataset flags."""
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.sharegpt_output_len = args.custom_output_len = args.output_len
    _at_least("num_prompts", args.num_prompts, 1)
    _at_least("random_input_len", args.random_input_len, 1)
    _at_least("random_output_len", args.random_output_len, 1)
    _at_least("random_prefix_len", args.random_prefix_len, 0)
    _at_least("custom_output_len", args.custom_output_len, 1)
    if args.sharegpt_output_len is not None:
        _at_least("sharegpt_output_len", args.sharegpt_output_len, 1)
    if args.max_concurrency is not None:
        _at_least("max_concurrency", args.max_concurrency, 1)
    if math.isnan(args.request_rate) or args.request_rate <= 0:
        raise ValueError(
            f"request_rate={args.request_rate} is not above 0: set --request-rate to requests per second "
            "(e.g. 4), or inf to send all at once"
        )
    if math.isnan(args.burstiness) or args.burstiness <= 0:
        raise ValueError(
            f"burstiness={args.burstiness} is not above 0: set --burstiness to 1 for Poisson arrivals, "
            "below 1 for burstier, above 1 for more even"
        )
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise ValueError(
            f"random_range_ratio={args.random_range_ratio} is outside [0, 1): set --random-range-ratio to a "
            "fraction such as 0.5"
        )
    if not args.request_timeout > 0:
        raise ValueError(f"request_timeout={args.request_timeout} is not above 0: give seconds, e.g. 600")
    if not 1 <= args.port <= 65535:
        raise ValueError(f"port={args.port} is outside 1..65535: set --port to the server's port")
    if args.base_url is not None and not args.base_url.startswith(("http://", "https://")):
        raise ValueError(
            f"--base-url {args.base_url} has no http:// or https:// scheme: write e.g. http://{args.base_url}"
        )
    if args.dataset_name == "random" and args.dataset_path is not None:
        raise ValueError(
            f"--dataset-path {args.dataset_path} is for the sharegpt and custom datasets: drop it, or set "
            "--dataset-name sharegpt or custom"
        )
    if args.dataset_name != "random" and args.dataset_path is None:
        raise ValueError(f"--dataset-name {args.dataset_name} reads a file: add --dataset-path FILE")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib, which is not installed: run `pip install matplotlib`")
    args.percentile_metrics_list = parse_percentile_metrics(args.percentile_metrics)
    args.metric_percentiles_list = parse_metric_percentiles(args.metric_percentiles)


def parse_percentile_metrics(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in METRIC_NAMES]
    if unknown or not names:
        raise ValueError(
            f"--percentile-metrics {text!r} names {', '.join(unknown) or 'no metric'}: use a comma-separated "
            f"list of {', '.join(METRIC_NAMES)}"
        )
    return names


def parse_metric_percentiles(text: str) -> list[float]:
    percents = []
    for item in (part.strip() for part in text.split(",")):
        try:
            percent = float(item)
        except ValueError:
            raise ValueError(
                f"--metric-percentiles {text!r} holds {item!r}, not a number: write e.g. 50,90,99"
            ) from None
        if not 0 < percent <= 100:
            raise ValueError(
                f"--metric-percentiles {text!r} holds {item}, outside (0, 100]: write e.g. 50,90,99"
            )
        percents.append(percent)
    return percents


def resolve_api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get("OPENAI_API_KEY") or None


def _at_least(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ValueError(
            f"{name}={value} is below the minimum {minimum}: "
            f"set --{name.replace('_', '-')} to {minimum} or more"
        )
