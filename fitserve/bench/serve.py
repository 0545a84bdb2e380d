"""`fitserve bench serve`: drive an OpenAI-compatible server with streamed requests and measure it.

Flow: probe the server (GET /v1/models, /version) -> load the tokenizer -> build the prompts -> send them
on their arrival schedule under the concurrency limit -> metrics (metrics.py) -> table, JSON and plot
(report.py, plot.py). A server that cannot be reached stops the run before any prompt is built.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm.auto import tqdm

from fitserve.bench import sse_http
from fitserve.bench.client import BACKEND_ENDPOINTS, RequestInput, RequestResult, send_request
from fitserve.bench.datasets import SampleRequest, describe_lengths, sample_requests
from fitserve.bench.metrics import RequestTiming, compute_metrics
from fitserve.bench.report import (
    TABLE_WIDTH,
    build_result_json,
    print_failures,
    print_summary,
    result_file_path,
    save_result_json,
)
from fitserve.bench.serve_args import check_serve_args, resolve_api_key
from fitserve.bench.spec_metrics import format_spec_decode, read_spec_counters, spec_decode_summary

PROBE_TIMEOUT_S = 10.0


class ServerUnreachable(Exception):
    """The server could not be asked anything; the message is one line that says what to check."""


@dataclass(frozen=True)
class ServerInfo:
    models: list[dict[str, Any]]  # /v1/models "data" entries; [] when the server has no such route
    version: str | None  # /version's "version", None when the server has no such route


def run_serve_benchmark(
    args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None = None
) -> dict[str, Any]:
    """The whole `bench serve` run; returns the result JSON (also saved with --save-result).

    `transport` replaces httpx's network transport (tests hand in an in-process one).
    """
    check_serve_args(args)
    return asyncio.run(_run(args, transport))


async def _run(args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None) -> dict[str, Any]:
    base_url = (args.base_url or f"http://{_host_for_url(args.host)}:{args.port}").rstrip("/")
    api_url = base_url + (args.endpoint or BACKEND_ENDPOINTS[args.backend])
    headers = {"Authorization": f"Bearer {key}"} if (key := resolve_api_key(args)) else {}
    limits = httpx.Limits(
        max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency
    )
    async with httpx.AsyncClient(timeout=None, limits=limits, trust_env=True, transport=transport) as client:
        server = await probe_server(client, base_url, headers)
        model_id, model_root = choose_model(args.model, server.models, base_url)
        tokenizer_id = resolve_tokenizer_path(args.tokenizer, model_id, model_root)
        print(f"Model: {model_id}; tokenizer: {tokenizer_id}")
        tokenizer = load_tokenizer(tokenizer_id, args.trust_remote_code)
        requests = build_requests(args, tokenizer)
        print(f"Dataset {args.dataset_name}: {describe_lengths(requests)}")
        ignore_eos = args.ignore_eos or args.dataset_name == "random"
        sampling = _sampling_fields(args, ignore_eos)
        inputs = [
            RequestInput(
                backend=args.backend,
                api_url=api_url,
                model=args.served_model_name or model_id,
                prompt=request.prompt,
                prompt_len=request.prompt_len,
                output_len=request.expected_output_len,
                sampling=sampling,
                headers=headers,
                timeout_s=args.request_timeout,
            )
            for request in requests
        ]
        offsets = arrival_offsets(
            len(inputs), args.request_rate, args.burstiness, np.random.default_rng(args.seed)
        )
        _print_traffic(args)
        spec_before = await read_spec_counters(client, base_url, headers)
        raw_http = transport is None and sse_http.takes_url(api_url) and not _proxied(api_url)
        results, duration = await run_requests(
            client, inputs, offsets, args.max_concurrency, args.disable_tqdm, raw_http
        )
        spec = spec_decode_summary(spec_before, await read_spec_counters(client, base_url, headers))
    timings, output_lens = collect_timings(results, tokenizer)
    metrics = compute_metrics(timings, len(results) - len(timings), duration, args.metric_percentiles_list)
    print_summary(metrics, args.percentile_metrics_list, args.max_concurrency, args.request_rate)
    if spec:
        print(format_spec_decode(spec, TABLE_WIDTH))
    print_failures(results)
    result = build_result_json(
        args, metrics, results, output_lens, model_id=model_id, tokenizer_id=tokenizer_id, server=server
    )
    result.update(spec)
    path = result_file_path(args, model_id, result["date"])
    if args.save_result:
        save_result_json(result, path, args.save_detailed)
        print(f"Results saved to {path}")
    if args.plot is not None:
        from fitserve.bench.plot import plot_serve_results

        png = Path(args.plot) if args.plot else path.with_suffix(".png")
        plot_serve_results(results, metrics, png)
        print(f"Plot saved to {png}")
    return result


async def probe_server(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> ServerInfo:
    """GET /v1/models and /version; only an unreachable server or a refused key is an error here."""
    try:
        response = await client.get(f"{base_url}/v1/models", headers=headers, timeout=PROBE_TIMEOUT_S)
    except httpx.TimeoutException:
        raise ServerUnreachable(
            f"the server at {base_url} did not answer GET /v1/models within {PROBE_TIMEOUT_S:g} s: "
            "check that it has finished starting"
        ) from None
    except httpx.HTTPError as error:
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ServerUnreachable(
            f"cannot reach the server at {base_url} ({reason}): start it with `fitserve serve`, "
            "or point --base-url or --host/--port at it"
        ) from None
    if response.status_code in (401, 403):
        raise ServerUnreachable(
            f"the server at {base_url} refused the request (HTTP {response.status_code}): pass --api-key KEY "
            "or set OPENAI_API_KEY"
        )
    models: list[dict[str, Any]] = []
    if response.status_code == 200:
        with contextlib.suppress(ValueError):
            data = response.json().get("data")
            models = [entry for entry in data or [] if isinstance(entry, dict) and "id" in entry]
    version = None
    with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError):
        answer = await client.get(f"{base_url}/version", headers=headers, timeout=PROBE_TIMEOUT_S)
        if answer.status_code == 200:
            version = answer.json().get("version")
    return ServerInfo(models=models, version=version if isinstance(version, str) else None)


def choose_model(
    requested: str | None, models: list[dict[str, Any]], base_url: str
) -> tuple[str, str | None]:
    """(model id, its "root" path on the server if listed)."""
    roots = {entry["id"]: entry.get("root") for entry in models}
    if requested is not None:
        return requested, roots.get(requested)
    if not models:
        raise ServerUnreachable(f"the server at {base_url} lists no model at /v1/models: pass --model NAME")
    first = models[0]
    return first["id"], first.get("root")


def resolve_tokenizer_path(tokenizer: str | None, model_id: str, model_root: str | None) -> str:
    """--tokenizer (found as the engine finds one: the default model's id works offline, a folder
    without tokenizer files is refused with the fix); else the model (or its server-side root) when it
    is a local folder with a tokenizer; else fitserve's default model's tokenizer."""
    from fitserve.models import resolve

    if tokenizer:
        return resolve.resolve_tokenizer_path(tokenizer)
    for candidate in (model_id, model_root):
        if candidate and any((Path(candidate) / name).is_file() for name in resolve.TOKENIZER_FILES):
            return candidate
    return resolve.resolve_model(None).tokenizer_path


def load_tokenizer(path: str, trust_remote_code: bool) -> Any:
    from fitserve.models import loader

    try:
        return loader.load_tokenizer(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        reason = " ".join(str(error).split())[:200]
        raise ValueError(f"cannot load the tokenizer {path} ({reason}): pass --tokenizer FOLDER") from None


def build_requests(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    return sample_requests(
        args.dataset_name,
        tokenizer,
        args.num_prompts,
        dataset_path=args.dataset_path,
        seed=args.seed,
        random_options={
            "input_len": args.random_input_len,
            "output_len": args.random_output_len,
            "range_ratio": args.random_range_ratio,
            "prefix_len": args.random_prefix_len,
        },
        output_len=args.sharegpt_output_len if args.dataset_name == "sharegpt" else args.custom_output_len,
        apply_chat_template=args.backend == "openai" and not args.skip_chat_template,
    )


def arrival_offsets(
    num_requests: int, request_rate: float, burstiness: float, rng: np.random.Generator
) -> list[float]:
    """Seconds after the start at which each request is sent.

    inf: all at 0. Otherwise the gaps are gamma-distributed with shape `burstiness` and mean
    1 / request_rate (burstiness 1 = exponential gaps = Poisson arrivals), and the schedule is scaled so
    the last request goes out at num_requests / request_rate, as vLLM does to steady the throughput.
    """
    if math.isinf(request_rate):
        return [0.0] * num_requests
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    offsets = np.cumsum(gaps)
    if offsets[-1] > 0:
        offsets *= (num_requests / request_rate) / offsets[-1]
    return offsets.tolist()


def _proxied(url: str) -> bool:
    """True when the environment sends `url` through a proxy (httpx honours it; sse_http does not)."""
    proxies = urllib.request.getproxies()
    host = urllib.parse.urlsplit(url).hostname or ""
    return bool(proxies.get("http") or proxies.get("all")) and not urllib.request.proxy_bypass(host)


async def run_requests(
    client: httpx.AsyncClient,
    inputs: Sequence[RequestInput],
    offsets: Sequence[float],
    max_concurrency: int | None,
    disable_tqdm: bool = True,
    raw_http: bool = False,
) -> tuple[list[RequestResult], float]:
    """Send each request at its offset, at most max_concurrency at once; (results in input order, seconds).
    raw_http: each timed request over a plain HTTP/1.1 connection of its own (bench/sse_http.py)."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    bar = tqdm(total=len(inputs), disable=disable_tqdm)

    async def limited(request: RequestInput) -> RequestResult:
        async with limit:
            result = await send_request(client, request, raw_http)
        bar.update(1)
        return result

    started = time.perf_counter()
    tasks = []
    for offset, request in zip(offsets, inputs, strict=True):
        wait = started + offset - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(limited(request)))
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - started
    bar.close()
    return results, duration


def collect_timings(
    results: Sequence[RequestResult], tokenizer: Any
) -> tuple[list[RequestTiming], list[int]]:
    """Timings of the successful requests, and every request's output tokens (0 for a failed one).

    Output tokens: the server's usage.completion_tokens when it sent a non-zero count, else the generated
    text's token count with the benchmark's tokenizer.
    """
    timings, output_lens = [], []
    for result in results:
        if not result.success:
            output_lens.append(0)
            continue
        output_tokens = result.usage_completion_tokens or len(
            tokenizer(result.generated_text, add_special_tokens=False).input_ids
        )
        output_lens.append(output_tokens)
        timings.append(
            RequestTiming(
                prompt_len=result.prompt_len,
                output_tokens=output_tokens,
                ttft=result.ttft,
                itl=tuple(result.itl),
                latency=result.latency,
                start_time=result.start_time,
            )
        )
    return timings, output_lens


def _sampling_fields(args: argparse.Namespace, ignore_eos: bool) -> dict[str, Any]:
    fields = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    sampling = {name: value for name, value in fields.items() if value is not None}
    if ignore_eos:
        sampling["ignore_eos"] = True
    return sampling


def _print_traffic(args: argparse.Namespace) -> None:
    arrivals = (
        "all at once"
        if math.isinf(args.request_rate)
        else ("Poisson process" if args.burstiness == 1.0 else f"gamma gaps, burstiness {args.burstiness:g}")
    )
    print(f"Traffic request rate: {args.request_rate:g} req/s ({arrivals})")
    print(f"Maximum request concurrency: {args.max_concurrency}")


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
