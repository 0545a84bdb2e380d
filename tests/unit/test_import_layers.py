"""Imports run one way through fitserve's layers (docs/engine.md, "Layers and where things live").

Every module under fitserve/ is read with `ast`, and every import in it counts: at the top, under
`if TYPE_CHECKING:`, inside a function or a `try:`. A module may import its own layer and the layers below
it, never one above. `fitserve/__init__.py`, the public lazy facade, may import anything.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import fitserve

PACKAGE_DIR = Path(fitserve.__file__).resolve().parent

# Top to bottom. Each layer is a list of module prefixes: a prefix names a module or a package and all of
# the modules under it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cli", ("fitserve.cli", "fitserve.__main__")),
    ("entrypoints", ("fitserve.server", "fitserve.bench")),
    ("engine", ("fitserve.engine",)),
    # the speculative decoders that run a second model beside the target's runner
    (
        "worker",
        (
            "fitserve.worker",
            "fitserve.spec_decode.draft_model",
            "fitserve.spec_decode.eagle3",
            "fitserve.spec_decode.mtp",
        ),
    ),
    ("planner", ("fitserve.planner",)),
    ("models", ("fitserve.models",)),
    ("layers", ("fitserve.layers",)),
    ("distributed", ("fitserve.distributed",)),
    ("kernels", ("fitserve.kernels",)),
    ("core", ("fitserve.core", "fitserve.spec_decode", "fitserve.structured.manager")),
    (
        "base",
        (
            "fitserve.config",
            "fitserve.args",
            "fitserve.args_explicit",
            "fitserve.args_support",
            "fitserve.logger",
            "fitserve.arg_parser",
            "fitserve.cpu_kv_cache",
            "fitserve.paths",
            "fitserve.offload_split",
            "fitserve.capture_sizes",
            "fitserve.kv_layers",
            "fitserve.kv_groups",
            "fitserve.spec_decode.config",
            "fitserve.structured",
            "fitserve.token_bytes",
        ),
    ),
)

# The facade: it may import anything, and importing it (`import fitserve`) imports nothing else.
FACADE = "fitserve"


@dataclass(frozen=True)
class ImportEdge:
    importer: str
    imported: str
    line: int


def layer_index(module: str, layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS) -> int | None:
    """The index in `layers` of the layer `module` belongs to (the longest prefix wins), or None."""
    best: tuple[int, int] | None = None  # (prefix length, layer index)
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if _under(module, prefix) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def fitserve_sources(package_dir: Path = PACKAGE_DIR) -> dict[str, tuple[str, bool]]:
    """Every module under fitserve/: its dotted name -> (source, whether it is a package's __init__)."""
    sources: dict[str, tuple[str, bool]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        sources[".".join(parts)] = (path.read_text(encoding="utf-8"), is_package)
    return sources


def imports_of(
    module: str,
    source: str,
    is_package: bool,
    known_modules: Iterable[str],
    facade_names: Mapping[str, str],
) -> list[ImportEdge]:
    """The fitserve modules that `module` imports, anywhere in its source, relative imports resolved."""
    known = set(known_modules)
    package = module if is_package else module.rpartition(".")[0]
    edges: list[ImportEdge] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names = []
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in known:
                    names.append(submodule)
                elif base == FACADE and alias.name in facade_names:
                    names.append(facade_names[alias.name])
                else:
                    names.append(base)
        else:
            continue
        edges.extend(ImportEdge(module, name, node.lineno) for name in names if _under(name, FACADE))
    return edges


def upward_imports(
    sources: Mapping[str, tuple[str, bool]],
    layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS,
    facade_names: Mapping[str, str] | None = None,
) -> list[str]:
    """The imports that go up a layer, as messages."""
    facade_names = fitserve._LAZY if facade_names is None else facade_names
    problems: dict[str, None] = {}  # ordered, without repeats (`from a import b, c` is one line)
    for module, (source, is_package) in sorted(sources.items()):
        if module == FACADE:
            continue
        importer_layer = layer_index(module, layers)
        for edge in imports_of(module, source, is_package, sources, facade_names):
            if edge.imported == FACADE:
                continue
            imported_layer = layer_index(edge.imported, layers)
            if importer_layer is None or imported_layer is None or imported_layer >= importer_layer:
                continue  # a module outside the layers is reported by its own test
            message = (
                f"{module} -> {edge.imported} (layer {layers[importer_layer][0]} may not import layer "
                f"{layers[imported_layer][0]}), line {edge.line}"
            )
            problems[message] = None
    return list(problems)


def test_every_module_is_in_a_layer() -> None:
    unplaced = [m for m in fitserve_sources() if m != FACADE and layer_index(m) is None]
    assert not unplaced, (
        "these modules are in no layer: add them to LAYERS here and to docs/engine.md's table: "
        + ", ".join(unplaced)
    )


def test_imports_go_down_the_layers() -> None:
    problems = upward_imports(fitserve_sources())
    assert not problems, "imports that go up a layer:\n" + "\n".join(problems)


def test_checker_catches_an_upward_import() -> None:
    sources = {
        "fitserve.kernels": ("", True),
        "fitserve.kernels.ok": ("import torch\nfrom fitserve.config import ModelConfig\n", False),
        # Relative, inside a function.
        "fitserve.kernels.nested.bad": ("def f():\n    from ...layers import linear\n", False),
        # Only for type checking.
        "fitserve.core.typed": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from fitserve.worker.sampler import SamplingRow\n",
            False,
        ),
        # A name of the facade resolves to the module that defines it.
        "fitserve.models.facade_user": ("from fitserve import LLM\nimport fitserve\n", False),
        "fitserve.layers.linear": ("from . import activation\nfrom fitserve.kernels import ok\n", False),
    }
    problems = upward_imports(sources, facade_names={"LLM": "fitserve.engine.llm"})
    assert problems == [
        "fitserve.core.typed -> fitserve.worker.sampler (layer core may not import layer worker), line 3",
        "fitserve.kernels.nested.bad -> fitserve.layers.linear (layer kernels may not import layer layers), "
        "line 2",
        "fitserve.models.facade_user -> fitserve.engine.llm (layer models may not import layer engine), "
        "line 1",
    ]


def test_a_module_takes_the_layer_of_its_longest_prefix() -> None:
    def layer_name(module: str) -> str | None:
        index = layer_index(module)
        return None if index is None else LAYERS[index][0]

    assert layer_name("fitserve.layers.attention.backend") == "layers"
    assert layer_name("fitserve.cli") == "cli" and layer_name("fitserve.cli.plan") == "cli"
    assert layer_name("fitserve.clients") is None  # a prefix is a whole name, not the start of one
    assert layer_name("fitserve.paths") == "base"
    # A longer prefix in a lower layer wins over a shorter one above it.
    layers = (("upper", ("fitserve.a",)), ("lower", ("fitserve.a.b",)))
    assert layer_index("fitserve.a.b.c", layers) == 1 and layer_index("fitserve.a.c", layers) == 0
