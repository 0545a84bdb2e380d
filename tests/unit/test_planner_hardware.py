"""--assume-gpus parsing (each bad value refused naming it and the accepted form) and the host probes."""

from __future__ import annotations

from pathlib import Path

import pytest

from fitserve.planner.hardware import GiB, HostInfo, cpu_device, parse_assume_gpus, probe_host, read_meminfo


def test_count_and_size() -> None:
    devices = parse_assume_gpus("2x20")
    assert [d.total_bytes for d in devices] == [20 * GiB, 20 * GiB]
    assert [d.index for d in devices] == [0, 1]
    assert all(d.assumed and d.kind == "cuda" and d.free_bytes == d.total_bytes for d in devices)
    assert devices[0].capability is None


def test_decimal_size_and_capability() -> None:
    (device,) = parse_assume_gpus("1x79.5@8.0")
    assert device.total_bytes == round(79.5 * GiB)
    assert device.capability == (8, 0)
    assert device.label() == "GPU 0 (assumed GPU, 79.50 GiB, SM 8.0)"


def test_groups_suffixes_and_case() -> None:
    devices = parse_assume_gpus("1X24GiB@8.6, 1x8g@7.5")
    assert [(round(d.total_gib, 2), d.capability) for d in devices] == [(24.0, (8, 6)), (8.0, (7, 5))]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", r"--assume-gpus '' is empty: write COUNTxGiB\[@SM\], e.g. 1x24"),
        ("24", r"'24' is not COUNTxGiB \(did you mean 1x24\?\): write COUNTxGiB"),
        ("0x24", r"GPU count '0' is not a whole number of 1 or more: write COUNTxGiB"),
        ("1.5x24", r"GPU count '1.5' is not a whole number"),
        ("2x", r"memory '' is not a number of GiB: write COUNTxGiB"),
        ("2xlots", r"memory 'lots' is not a number of GiB"),
        ("1x0", r"memory 0 GiB is outside \(0, 4096\]: give each GPU's memory in GiB"),
        ("1x9000", r"memory 9000 GiB is outside \(0, 4096\]"),
        ("1x24GB", r"'24GB' is in GB \(10\*\*9 bytes\); the planner counts GiB \(2\*\*30\): write 22.35"),
        ("1x24@80", r"compute capability '80' is not MAJOR.MINOR \(did you mean 8.0\?\)"),
        ("1x24@ampere", r"compute capability 'ampere' is not MAJOR.MINOR: write it as"),
        ("1x24@2.0", r"compute capability 2.0 is below 3.0"),
        ("65x1", r"describes 65 GPUs, above the maximum 64"),
    ],
)
def test_bad_values_name_the_value_and_the_fix(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        parse_assume_gpus(text)
    assert f"--assume-gpus {text!r}" in str(error.value)


def test_meminfo_is_read_in_bytes(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    path.write_text(
        "MemTotal:       16318580 kB\nMemFree:         1000 kB\nMemAvailable:    8000000 "
        "kB\nHugePages_Total:       0\n"
    )
    values = read_meminfo(str(path))
    assert values["MemTotal"] == 16318580 * 1024
    assert values["MemAvailable"] == 8000000 * 1024
    assert values["HugePages_Total"] == 0
    assert read_meminfo(str(tmp_path / "absent")) == {}


def test_host_probe_and_cpu_device(tmp_path: Path) -> None:
    host = probe_host(cache_dir=str(tmp_path / "not-yet-created" / "cache"))
    assert host.ram_total_bytes >= host.ram_available_bytes > 0
    assert host.cache_disk_free_bytes > 0  # measured on the nearest existing folder
    assert host.python_version.count(".") == 2
    device = cpu_device(host)
    assert device.kind == "cpu" and device.total_bytes == host.ram_total_bytes
    assert device.free_bytes == host.ram_available_bytes


def test_cpu_device_label() -> None:
    host = HostInfo(2, 16 * GiB, 8 * GiB, None, None, "/cache", 100 * GiB, "3.11.0", "2.13.0", None, None)
    assert cpu_device(host).label() == "CPU (2 cores, 16.0 GiB RAM)"
