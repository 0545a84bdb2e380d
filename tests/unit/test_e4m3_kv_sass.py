"""The attention kernels over a float8 e4m3 KV cache beside bfloat16 queries, compiled here for sm_90 (no GPU:
kernels/variants.py's launch case e4m3_kv_cache, Triton's bundled ptxas). The launchers pass the cache as its
bytes (attention_inputs.kv_cache_for_kernels) and fp8_bits.stored_values decodes them with
e4m3_bytes_to_bfloat16, in integer instructions: the kernels keep the conversion unit (F2F, F2FP: a quarter
of the integer rate) out of the key and value loads, which Triton's e4m3 -> float16 -> bfloat16 fills
(three conversions a pair; BF16_FROM_BYTES=False gives that form back). Each form compiles in a child
process (the harness swaps Triton's driver while it runs): `python tests/unit/test_e4m3_kv_sass.py 0|1`."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ATTENTION = ("_decode_partition_kernel", "_prefill_kernel")
CACHE_ARGUMENT = 1  # the cache pointer's place in both kernels' signatures


def _opcodes_by_kernel(from_bytes: bool) -> dict[str, dict]:
    """{kernel: {"cache": its cache pointer's type, "ops": F2F / F2FP counts}} for the attention kernels."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FITSERVE_KERNEL_TARGET")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, __file__, "1" if from_bytes else "0"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def by_bytes() -> dict[str, dict]:
    return _opcodes_by_kernel(True)


def test_the_cache_reaches_the_attention_kernels_as_bytes(by_bytes: dict[str, dict]) -> None:
    assert set(by_bytes) == set(ATTENTION), sorted(by_bytes)
    assert {kernel["cache"] for kernel in by_bytes.values()} == {"*u8"}, by_bytes


def test_decoding_the_bytes_leaves_the_conversion_unit_out(by_bytes: dict[str, dict]) -> None:
    converted = _opcodes_by_kernel(False)
    assert {kernel["cache"] for kernel in converted.values()} == {"*fp8e4nv"}, converted
    for name in ATTENTION:
        assert by_bytes[name]["ops"].get("F2F", 0) == 0, (name, by_bytes[name])
        # Triton's form: an F2F an element and an F2FP a pair of every key and value tile it loads (why
        # bytes); the F2FP left in the bytes' form pack the float32 probabilities and outputs
        conversions, packs = converted[name]["ops"].get("F2F", 0), converted[name]["ops"].get("F2FP", 0)
        assert conversions >= 64, (name, converted[name])
        assert by_bytes[name]["ops"].get("F2FP", 0) <= packs - conversions // 2, (name, by_bytes[name])


def _compile_and_count(from_bytes: bool) -> dict[str, dict]:
    from fitserve.kernels import fp8_bits, variants
    from fitserve.kernels.launch_cases import LAUNCH_CASES

    fp8_bits.BF16_FROM_BYTES = from_bytes
    found: dict[str, dict] = {}
    usage = variants._usage

    def counting_usage(compiled):
        name = compiled.src.fn.__name__
        if name in ATTENTION:
            with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
                cubin.write(compiled.asm["cubin"])
                cubin.flush()
                sass = subprocess.run(
                    [variants._cuobjdump(), "-sass", cubin.name], capture_output=True, text=True, check=True
                ).stdout
            signature = [str(v) for v in compiled.src.signature.values()]
            ops = collections.Counter(re.findall(r"\b(F2F|F2FP)\b", sass))
            found[name] = {"cache": signature[CACHE_ARGUMENT], "ops": dict(ops)}
        return usage(compiled)

    variants._usage = counting_usage
    cases = {"e4m3_kv_cache": LAUNCH_CASES["e4m3_kv_cache"]}
    failed = [
        row for row in variants.report(variants.TARGETS_BY_NAME["sm_90"], False, cases) if row["problems"]
    ]
    assert not failed, failed
    return found


if __name__ == "__main__":
    print(json.dumps(_compile_and_count(sys.argv[1] == "1")))
