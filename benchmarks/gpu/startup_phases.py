"""Where the seconds before fitserve's engine starts go: importing torch, creating the CUDA context,
importing transformers' config code, reading config.json, loading the tokenizer. Each phase is timed
in a fresh process in the order the engine meets them.
  python benchmarks/gpu/startup_phases.py
"""

from __future__ import annotations

import argparse
import time

from common import MODELS, TOKENIZER, save  # noqa: I001


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    phases: dict[str, float] = {}
    mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name] = round(now - mark, 2)
        mark = now

    import torch

    lap("import_torch_s")
    if torch.cuda.is_available():
        torch.cuda.init()
        torch.cuda.mem_get_info()
        lap("cuda_context_s")
    import fitserve  # noqa: F401

    lap("import_fitserve_s")
    from transformers import AutoConfig

    lap("import_transformers_autoconfig_s")
    AutoConfig.from_pretrained(str(MODELS / args.model))
    lap("load_config_json_s")
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(TOKENIZER))
    lap("load_tokenizer_s")
    save("startup_phases", {"model": args.model, **phases}, args.out)


if __name__ == "__main__":
    main()
