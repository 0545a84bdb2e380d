"""`fitserve serve` flags of the HTTP layer (engine flags live in fitserve/args.py), with vLLM's names.

`add_server_args(parser)` adds them; `ServerSettings.from_namespace(ns)` checks them once, before
anything loads, and refuses a bad combination with a message naming the flag and the fix.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fitserve.server.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

# --chat-template-content-format values (fitserve/server/chat.py renders each). Parsing the flags imports
# no web framework: fastapi and jinja2 load when the server starts, beside the model.
CONTENT_FORMAT_CHOICES = ("auto", "string", "openai")

API_KEY_ENV_VARS = ("FITSERVE_API_KEY", "VLLM_API_KEY")
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _cors_item(value: str) -> list[str]:
    """One CORS value: vLLM's JSON list ('["http://a", "http://b"]') or a single bare item (http://a)."""
    if not value.lstrip().startswith("["):
        return [value]
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{value!r} is not a JSON list such as '[\"*\"]' ({exc})") from exc
    if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
        raise argparse.ArgumentTypeError(
            f'{value!r} is not a JSON list of strings such as \'["GET", "POST"]\''
        )
    return parsed


def _flatten(values: list[str | list[str]]) -> list[str]:
    flat: list[str] = []
    for value in values:
        flat.extend(value if isinstance(value, list) else [value])
    return flat


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("server", "the OpenAI-compatible HTTP server")
    group.add_argument("--host", default="127.0.0.1", help="Address to bind; 0.0.0.0 exposes the server.")
    group.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    group.add_argument(
        "--api-key",
        default=None,
        help="Require `Authorization: Bearer KEY` on every route but /health, /ping, /version and /metrics. "
        "Also read from FITSERVE_API_KEY or VLLM_API_KEY.",
    )
    group.add_argument(
        "--chat-template", default=None, help="A Jinja chat template: a file path or the text."
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="Run chat templates that requests send (chat_template field); off by default since a "
        "template is code the server runs.",
    )
    group.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=CONTENT_FORMAT_CHOICES,
        help="How message content reaches the template: 'string' or 'openai' (a list of parts).",
    )
    group.add_argument("--response-role", default="assistant", help="Role of generated chat messages.")
    group.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="Put the reasoning part of the output (<think>...</think>; gemma4: its thought channel) in "
        "reasoning_content.",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="Let the model call the request's tools (needs --tool-call-parser).",
    )
    group.add_argument(
        "--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS), help="Tool-call output format."
    )
    group.add_argument("--disable-log-requests", action="store_true", help="No log line per request.")
    group.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS)
    group.add_argument("--disable-uvicorn-access-log", action="store_true", help="No uvicorn access log.")
    group.add_argument(
        "--allowed-origins",
        type=_cors_item,
        nargs="+",
        default=["*"],
        help="CORS origins: a JSON list or items.",
    )
    group.add_argument(
        "--allowed-methods",
        type=_cors_item,
        nargs="+",
        default=["*"],
        help="CORS methods: a JSON list or items.",
    )
    group.add_argument(
        "--allowed-headers",
        type=_cors_item,
        nargs="+",
        default=["*"],
        help="CORS headers: a JSON list or items.",
    )
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials.")
    group.add_argument("--root-path", default=None, help="Path prefix when behind a path-based proxy.")
    group.add_argument("--ssl-keyfile", default=None, help="TLS private key file (with --ssl-certfile).")
    group.add_argument("--ssl-certfile", default=None, help="TLS certificate file (with --ssl-keyfile).")
    group.add_argument("--ssl-ca-certs", default=None, help="CA certificates file for client verification.")
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="Refuse request bodies larger than this (413).",
    )
    group.add_argument("--disable-fastapi-docs", action="store_true", help="No /docs, /redoc, /openapi.json.")
    group.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="Logprobs name tokens as 'token_id:N' instead of their text (also a per-request field).",
    )
    group.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="Serve GET /tokenizer_info (the tokenizer's configuration and chat template).",
    )
    group.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help='Serve GET /load: {"server_load": generation requests in flight}.',
    )
    group.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="Add an X-Request-Id header to every response (the request's own, else a new one).",
    )
    group.add_argument(
        "--disable-frontend-multiprocessing",
        action="store_true",
        help="Run the engine on a thread of the server's process, as on the CPU, instead of in a process of "
        "its own (the default on a GPU).",
    )
    group.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="Log a line per request (vLLM's newer flag; fitserve logs them unless --disable-log-requests).",
    )
    group.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="Request log lines also show the prompt, cut to this many characters (and token ids). "
        "Default: no prompt in the log.",
    )
    group.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details.cached_tokens: the prompt tokens found in the prefix cache.",
    )
    group.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="usage in every response, streams included, as if each asked stream_options.include_usage.",
    )
    group.add_argument(
        "--middleware",
        action="append",
        default=[],
        help="An ASGI middleware to add, by import path (module.name): a class is added with "
        "app.add_middleware, a function as an HTTP middleware. Repeat for several.",
    )
    group.add_argument(
        "--api-server-count",
        "-asc",
        type=int,
        default=1,
        help="Accepted for vLLM compatibility; fitserve runs one API server process beside its engine.",
    )
    group.add_argument(
        "--lora-modules", nargs="+", default=None, help="LoRA adapters as name=path (not supported yet)."
    )
    group.add_argument(
        "--prompt-adapters", nargs="+", default=None, help="Prompt adapters (not supported yet)."
    )
    group.add_argument(
        "--ssl-cert-reqs", type=int, default=0, help="Whether client certificates are required (ssl module)."
    )
    group.add_argument(
        "--ssl-ciphers", default=None, help="The TLS ciphers uvicorn offers (OpenSSL cipher list format)."
    )
    group.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=None,
        help="Most bytes of an HTTP request's head uvicorn buffers. Default: uvicorn's.",
    )
    group.add_argument(
        "--h11-max-header-count",
        type=int,
        default=None,
        help="Accepted for vLLM compatibility; uvicorn's size limit above bounds the headers.",
    )
    return parser


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    chat_template: str | None = None  # the template text, already read from its file
    chat_template_content_format: str = "auto"
    trust_request_chat_template: bool = False
    response_role: str = "assistant"
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    disable_log_requests: bool = False
    uvicorn_log_level: str = "info"
    disable_uvicorn_access_log: bool = False
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    root_path: str | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    disable_fastapi_docs: bool = False
    return_tokens_as_token_ids: bool = False
    enable_tokenizer_info_endpoint: bool = False
    enable_server_load_tracking: bool = False
    enable_request_id_headers: bool = False
    disable_frontend_multiprocessing: bool = False
    enable_log_requests: bool = False
    max_log_len: int | None = None
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    middleware: list[str] = field(default_factory=list)
    api_server_count: int = 1
    lora_modules: list[str] | None = None
    prompt_adapters: list[str] | None = None
    ssl_cert_reqs: int = 0
    ssl_ciphers: str | None = None
    h11_max_incomplete_event_size: int | None = None
    h11_max_header_count: int | None = None

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServerSettings:
        """Read and check the server flags; the API key falls back to FITSERVE_API_KEY, then VLLM_API_KEY."""
        names = [f for f in cls.__dataclass_fields__ if hasattr(ns, f)]
        values = {name: getattr(ns, name) for name in names}
        if not values.get("api_key"):
            values["api_key"] = next((os.environ[v] for v in API_KEY_ENV_VARS if os.environ.get(v)), None)
        if values.get("chat_template") is not None:  # a file or inline text, checked before the model loads
            from fitserve.server.chat import load_chat_template

            values["chat_template"] = load_chat_template(values["chat_template"])
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            if name in values:
                values[name] = _flatten(values[name])
        settings = cls(**values)
        settings.check()
        return settings

    def check(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"--port {self.port} is outside 1..65535: pick a free port such as 8000")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError(
                "--enable-auto-tool-choice needs a parser: add --tool-call-parser "
                + " or ".join(sorted(TOOL_CALL_PARSERS))
            )
        if self.max_request_body_bytes < 1024:
            raise ValueError(
                f"--max-request-body-bytes {self.max_request_body_bytes} is below the minimum 1024: "
                "set it to 1024 or more (the default is 16 MiB)"
            )
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise ValueError("TLS needs both --ssl-keyfile and --ssl-certfile: give both, or neither")
        for flag, path in (
            ("--ssl-keyfile", self.ssl_keyfile),
            ("--ssl-certfile", self.ssl_certfile),
            ("--ssl-ca-certs", self.ssl_ca_certs),
        ):
            if path and not Path(path).is_file():
                raise ValueError(f"{flag} {path!r} is not a file: give the path of an existing PEM file")
        if self.enable_log_requests and self.disable_log_requests:
            raise ValueError("--enable-log-requests and --disable-log-requests contradict: drop one")
        for flag, value, minimum in (
            ("--max-log-len", self.max_log_len, 0),
            ("--api-server-count", self.api_server_count, 1),
            ("--h11-max-incomplete-event-size", self.h11_max_incomplete_event_size, 1),
            ("--h11-max-header-count", self.h11_max_header_count, 1),
        ):
            if value is not None and value < minimum:
                raise ValueError(
                    f"{flag} {value} is below the minimum {minimum}: set it to {minimum} or more"
                )
        if self.lora_modules:
            raise ValueError(
                f"not supported yet: --lora-modules {' '.join(self.lora_modules)} (merge the adapter into "
                "the weights and serve that folder, or drop --lora-modules)"
            )
        if self.prompt_adapters:
            raise ValueError(
                f"not supported yet: --prompt-adapters {' '.join(self.prompt_adapters)} (drop "
                "--prompt-adapters)"
            )
        for path in self.middleware:
            load_middleware(path)

    def accepted_no_ops(self) -> list[str]:
        """vLLM's server flags given that fitserve accepts without a mode of its own: one log line each."""
        notes = []
        if self.api_server_count > 1:
            notes.append(
                f"--api-server-count {self.api_server_count}: fitserve runs one API server process beside "
                "its engine (results are unchanged)"
            )
        if self.h11_max_header_count is not None:
            notes.append(
                f"--h11-max-header-count {self.h11_max_header_count}: uvicorn bounds a request's head by "
                "--h11-max-incomplete-event-size, not by a header count"
            )
        return notes

    @property
    def exposed_without_key(self) -> bool:
        return self.host not in ("127.0.0.1", "localhost", "::1") and not self.api_key

    @property
    def base_url(self) -> str:
        scheme = "https" if self.ssl_certfile else "http"
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"{scheme}://{host}:{self.port}{self.root_path or ''}"


def load_middleware(path: str) -> Any:
    """The object --middleware names (module.name or module:name); ValueError when it cannot be imported."""
    module_name, _, name = path.replace(":", ".").rpartition(".")
    if not module_name or not name:
        raise ValueError(f"--middleware {path!r} is not an import path: write it as package.module.name")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"--middleware {path!r} cannot be imported ({error}): give the import path of an ASGI "
            "middleware class or an HTTP middleware function on the server's Python path"
        ) from None


def server_only_keys(parser: argparse.ArgumentParser) -> frozenset[str]:
    """The option names (dests) of `fitserve serve`'s server flags that `parser` lacks: the keys of a serve
    config.yaml (host, port, api-key, ...) that a command running the engine alone skips."""
    server = argparse.ArgumentParser(add_help=False)
    add_server_args(server)
    known = {action.dest for action in parser._actions}
    return frozenset(action.dest for action in server._actions if action.option_strings) - known
