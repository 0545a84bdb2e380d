"""dense_linear off the GPU is F.linear, and it needs no Triton there."""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.nn.functional as F

from fitserve.layers.linear import dense_linear


def test_cpu_rows_take_f_linear_exactly() -> None:
    torch.manual_seed(0)
    x, weight, bias = torch.randn(3, 64), torch.randn(4096, 64), torch.randn(4096)
    assert torch.equal(dense_linear(x, weight, bias), F.linear(x, weight, bias))
    assert torch.equal(dense_linear(x, weight), F.linear(x, weight))


def test_the_layers_import_without_triton() -> None:
    blocker = (
        "import sys\n"
        "class NoTriton:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise ImportError('no triton here')\n"
        "sys.meta_path.insert(0, NoTriton())\n"
        "import torch\n"
        "from fitserve.layers.linear import dense_linear\n"
        "x = torch.ones(2, 8)\n"
        "assert dense_linear(x, torch.ones(4, 8)).sum().item() == 64\n"
    )
    subprocess.run([sys.executable, "-c", blocker], check=True)
