"""Shared test setup: paths to ../shared, and the default model's cache (built once per session)."""

from tests.paths import SHARED_DIR  # noqa: F401
from tests.unit.default_model_fixture import default_model_cache  # noqa: F401
