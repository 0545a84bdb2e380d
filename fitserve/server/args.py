"""`fitserve serve` flags of the HTTP layer (engine flags live in fitserve/args.py), with vLLM's names.

`add_server_args(parser)` adds them; `ServerSettings.from_namespace(ns)` checks them once, before
anything loads, and refuses a bad combination with a message naming the flag and the fix.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from fitserve.server.chat import CONTENT_FORMAT_CHOICES, load_chat_template
from fitserve.server.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

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
        help="Put the <think> part of the output in reasoning_content.",
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
        help="Accepted for vLLM compatibility; fitserve's server and engine always share one process.",
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

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServerSettings:
        """Read and check the server flags; the API key falls back to FITSERVE_API_KEY, then VLLM_API_KEY."""
        names = [f for f in cls.__dataclass_fields__ if hasattr(ns, f)]
        values = {name: getattr(ns, name) for name in names}
        if not values.get("api_key"):
            values["api_key"] = next((os.environ[v] for v in API_KEY_ENV_VARS if os.environ.get(v)), None)
        values["chat_template"] = load_chat_template(values.get("chat_template"))
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

    @property
    def exposed_without_key(self) -> bool:
        return self.host not in ("127.0.0.1", "localhost", "::1") and not self.api_key

    @property
    def base_url(self) -> str:
        scheme = "https" if self.ssl_certfile else "http"
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"{scheme}://{host}:{self.port}{self.root_path or ''}"


def server_only_keys(parser: argparse.ArgumentParser) -> frozenset[str]:
    """The option names (dests) of `fitserve serve`'s server flags that `parser` lacks: the keys of a serve
    config.yaml (host, port, api-key, ...) that a command running the engine alone skips."""
    server = argparse.ArgumentParser(add_help=False)
    add_server_args(server)
    known = {action.dest for action in parser._actions}
    return frozenset(action.dest for action in server._actions if action.option_strings) - known
