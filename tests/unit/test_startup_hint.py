"""The curl that `fitserve serve` logs at startup sends the API key by naming where it is, never the key."""

from __future__ import annotations

import pytest

from fitserve.server.api_server import _auth_header
from fitserve.server.args import API_KEY_ENV_VARS

KEY = "secret-4217"


@pytest.fixture(autouse=True)
def no_key_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in API_KEY_ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def test_no_key_no_header() -> None:
    assert _auth_header(None) == "" and _auth_header("") == ""


@pytest.mark.parametrize("variable", API_KEY_ENV_VARS)
def test_a_key_from_the_environment_is_sent_from_it(variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variable, KEY)
    assert _auth_header(KEY) == f' -H "Authorization: Bearer ${variable}"'


def test_a_key_from_the_command_line_is_not_printed() -> None:
    header = _auth_header(KEY)
    assert KEY not in header and header == ' -H "Authorization: Bearer <your --api-key>"'
