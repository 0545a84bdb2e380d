"""Each int4 format's quantization_config -> Int4Format, refusing the variants fitserve does not run.

Every refusal names the value, what runs, and the fix (docs/quantization.md lists them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fitserve.layers.quantization.quant_config import Int4Format

RUNS = (
    "int4 GPTQ (checkpoint_format gptq or gptq_v2), AWQ (version gemm), compressed-tensors pack-quantized "
    "W4A16, AutoRound (packing_format auto_round:auto_gptq)"
)
GROUP_SIZES = (-1, 32, 64, 128, 256)


def _bits(raw: dict[str, Any], key: str, method: str) -> None:
    bits = raw.get(key, 4)
    if bits != 4:
        raise ValueError(
            f"{method} {key}={bits}: fitserve runs 4-bit {method} checkpoints only; use the model's 4-bit "
            f"{method} release (bits 4)"
        )


def _group_size(value: Any, method: str) -> int:
    size = -1 if value is None else int(value)
    if size not in GROUP_SIZES:
        raise ValueError(
            f"{method} group_size={size}: fitserve runs group sizes {', '.join(map(str, GROUP_SIZES))} "
            "(-1: per-channel); use a checkpoint quantized with one of them"
        )
    return size


def gptq_format(raw: dict[str, Any], family: str) -> Int4Format:
    """GPTQ, and AutoRound in its auto_gptq packing (the same tensors)."""
    from fitserve.layers.quantization.quant_config import Int4Format

    name = "AutoRound" if family == "auto-round" else "GPTQ"
    if family == "auto-round":
        packing = str(raw.get("packing_format", "auto_round:auto_gptq"))
        if packing != "auto_round:auto_gptq":
            raise ValueError(
                f"AutoRound packing_format={packing!r}: fitserve runs packing_format auto_round:auto_gptq "
                "(GPTQ layout); export the model with format auto_gptq"
            )
        if str(raw.get("data_type", "int")) != "int":
            raise ValueError(
                f"AutoRound data_type={raw.get('data_type')!r}: fitserve runs integer (data_type int) "
                "AutoRound "
                "checkpoints; use an int4 export"
            )
        for layer, overrides in (raw.get("extra_config") or {}).items():
            if isinstance(overrides, dict) and overrides.get("bits", 4) not in (4, 16):
                raise ValueError(
                    f"AutoRound extra_config gives {layer} bits={overrides['bits']}: fitserve runs 4-bit "
                    "layers "
                    "(and 16-bit ones left unquantized); use a uniform 4-bit export"
                )
    _bits(raw, "bits", name)
    checkpoint_format = str(raw.get("checkpoint_format", "gptq")).lower()
    if raw.get("is_marlin_format") or checkpoint_format not in ("gptq", "gptq_v2"):
        shown = "marlin" if raw.get("is_marlin_format") else checkpoint_format
        raise ValueError(
            f"{name} checkpoint_format={shown!r}: fitserve runs GPTQ checkpoints stored as gptq (v1) or "
            "gptq_v2, "
            "not marlin- or other kernel-packed ones; use the model's plain GPTQ release"
        )
    if raw.get("lm_head"):
        raise ValueError(
            f"{name} lm_head=true (a quantized LM head): not supported yet; use a checkpoint whose "
            "lm_head is "
            "left in 16-bit"
        )
    if raw.get("dynamic"):
        raise ValueError(
            f"{name} dynamic per-module overrides ({sorted(raw['dynamic'])[:3]}): not supported yet; use a "
            "uniform 4-bit checkpoint"
        )
    ignore = list(raw.get("modules_to_not_convert") or [])
    ignore += [
        layer
        for layer, overrides in (raw.get("extra_config") or {}).items()
        if isinstance(overrides, dict) and overrides.get("bits") == 16
    ]
    return Int4Format(
        method=family,
        layout="gptq",
        group_size=_group_size(raw.get("group_size", 128), name),
        symmetric=bool(raw.get("sym", True)),
        act_order=bool(raw.get("desc_act", False)),
        zero_offset=1 if checkpoint_format == "gptq" else 0,
        ignore=tuple(ignore),
    )


def awq_format(raw: dict[str, Any]) -> Int4Format:
    from fitserve.layers.quantization.quant_config import Int4Format

    _bits(raw, "w_bit" if "w_bit" in raw else "bits", "AWQ")
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(
            f"AWQ version={version!r}: fitserve runs AWQ GEMM checkpoints (version gemm), not {version}'s "
            "packing; use the model's AWQ GEMM release"
        )
    if not raw.get("zero_point", True):
        raise ValueError("AWQ zero_point=false: fitserve runs AWQ with zero points (zero_point true)")
    size = raw.get("q_group_size", raw.get("group_size", 128))
    return Int4Format(
        method="awq",
        layout="awq",
        group_size=_group_size(size, "AWQ"),
        symmetric=False,
        act_order=False,
        ignore=tuple(raw.get("modules_to_not_convert") or ()),
    )


def compressed_tensors_format(raw: dict[str, Any]) -> Int4Format:
    from fitserve.layers.quantization.quant_config import Int4Format

    fmt = str(raw.get("format", ""))  # float-quantized (fp8) configs go to fp8_format.py instead
    groups = raw.get("config_groups") or {}
    schemes = []
    targets: list[str] = []
    for group_name, group in groups.items():
        group_fmt = group.get("format") or fmt
        if group_fmt != "pack-quantized":
            raise ValueError(
                f"compressed-tensors format {group_fmt!r} ({group_name}): fitserve runs 'pack-quantized' "
                "(int4 "
                "W4A16) only; use a W4A16 checkpoint of the model"
            )
        if group.get("input_activations") or group.get("output_activations"):
            raise ValueError(
                f"compressed-tensors {group_name} quantizes activations: fitserve runs weight-only W4A16 "
                "(input_activations null); use a W4A16 checkpoint"
            )
        weights = group.get("weights") or {}
        scheme = (
            weights.get("num_bits"),
            weights.get("type", "int"),
            weights.get("strategy"),
            weights.get("group_size"),
            bool(weights.get("symmetric", True)),
            weights.get("actorder"),
        )
        if scheme[0] != 4 or scheme[1] != "int":
            raise ValueError(
                f"compressed-tensors {group_name} weights num_bits={scheme[0]} type={scheme[1]!r}: "
                "fitserve runs "
                "num_bits 4, type int (W4A16); use a W4A16 checkpoint"
            )
        if scheme[2] not in ("group", "channel"):
            raise ValueError(
                f"compressed-tensors {group_name} strategy={scheme[2]!r}: fitserve runs strategy group or "
                "channel; use a W4A16 checkpoint with one of them"
            )
        schemes.append(scheme)
        targets += list(group.get("targets") or ["Linear"])
    if fmt not in ("pack-quantized", "mixed-precision") and not groups:
        raise ValueError(
            f"compressed-tensors format {fmt!r}: fitserve runs 'pack-quantized' (int4 W4A16) only; use a "
            "W4A16 checkpoint of the model"
        )
    if len(set(schemes)) != 1:
        raise ValueError(
            f"compressed-tensors config_groups hold {len(set(schemes))} different weight schemes: "
            "fitserve runs "
            "one int4 scheme for every quantized layer; use a uniform W4A16 checkpoint"
        )
    _, _, strategy, group_size, symmetric, actorder = schemes[0]
    size = -1 if strategy == "channel" else _group_size(group_size, "compressed-tensors")
    return Int4Format(
        method="compressed-tensors",
        layout="pack-quantized",
        group_size=size,
        symmetric=symmetric,
        act_order=actorder == "group",
        ignore=tuple(raw.get("ignore") or ()),
        targets=tuple(targets),
    )
