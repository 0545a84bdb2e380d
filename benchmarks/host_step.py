"""The engine's host time per decode step at 128 and 256 running requests, phase by phase, on the CPU.

The real Engine (scheduler, model runner, sampler, output processor) runs a tiny random Llama (2 layers,
hidden 64, vocabulary 256, SmolLM2's tokenizer) so that the model's own work is small and timed apart:
what is left is the Python a GPU step pays on the host (issue 27: on a fast GPU it stops hiding behind
the device's time). Every request has a ~600-token prompt and streams (CUMULATIVE outputs, as the
server's), ignore_eos, greedy (--temperature T samples: on the CPU its exponential draws, a
kernel on a GPU, then count in `sampler`). Once every prompt is computed, each
`Engine.step()` plans and launches one decode step of all N requests and takes the last one's tokens;
the phases below are timed by wrappers around the engine's own functions, with the engine thread's CPU
time (`--clock cpu`, the default: steadier than the wall clock while other work shares the machine):

    schedule       Scheduler.schedule
    sampling_rows  ModelRunner._sampling_rows (the step's per-request sampling rows)
    host_inputs    build_host_inputs (worker/step_inputs.py)
    upload         upload_inputs (the copy to the device and the attention metadata)
    sampler        Sampler.launch (host work plus a [N, 256] sampling on the CPU)
    launch_other   the rest of ModelRunner.launch (its bookkeeping)
    result         LaunchedStep.result (waiting for the tokens, the runner's output dicts)
    update         Scheduler.update_from_output
    apply_tokens   Engine._apply_tokens (grammars, detokenize, stop strings)
    make_outputs   OutputProcessor.make_outputs (the RequestOutputs)
    step_other     the rest of Engine.step
    send           what the engine process does per step to send them: get_stats, the delta encoding
                   (engine/output_deltas.py) and pickling the Reply (engine_process_pipe.py)
    forward, logits  the model's forward and LM head (model work, left out of host_total)
    gc             the cyclic garbage collector's time (already counted in the phase it interrupted;
                   full collections are rare, so its mean tells more than its median)

host_total = the whole Engine.step + send - forward - logits, in us per step (median over the steps;
the mean is kept too).

    python benchmarks/host_step.py [--batches 128 256] [--steps 150] [--temperature 0] [--label after]
        [--out benchmarks/results/cpu_host_step.json] [--profile N] [--settle-heap] [--clock cpu|wall]
    python benchmarks/host_step.py --summarize   # the lowest median per phase of runs NAME_1, NAME_2, ...

--label names the entry written to --out (other entries are kept); --profile N prints cProfile's top N
functions over the timed steps of the largest batch. The figures in results/cpu_host_step.json: the code
before (run from a copy of that commit, without --settle-heap, which it did not have) and after
(--settle-heap, as its engine process does), alternated three times each, then --summarize.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pickle
import platform
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fitserve.core.sampling_params import SamplingParams  # noqa: E402
from fitserve.core.scheduler import Scheduler  # noqa: E402
from fitserve.engine import engine as engine_module  # noqa: E402
from fitserve.engine.engine import Engine  # noqa: E402
from fitserve.engine.engine_process_pipe import Reply  # noqa: E402
from fitserve.engine.output_deltas import OutputEncoder  # noqa: E402
from fitserve.engine.output_processor import OutputProcessor  # noqa: E402
from fitserve.worker import model_runner as runner_module  # noqa: E402
from fitserve.worker.model_runner import LaunchedStep, ModelRunner  # noqa: E402
from fitserve.worker.sampler import Sampler  # noqa: E402
from tests.paths import SMOLLM2_TOKENIZER_DIR  # noqa: E402
from tests.unit.model_helpers import build_hf_model, tiny_hf_config  # noqa: E402

PROMPT_LEN = 600
BLOCK_SIZE = 16
PHASES = (
    "schedule",
    "sampling_rows",
    "host_inputs",
    "upload",
    "sampler",
    "launch_other",
    "result",
    "update",
    "apply_tokens",
    "make_outputs",
    "step_other",
    "send",
)


class PhaseClock:
    """Wraps functions so that each call adds its time (`clock`) to a phase of the current step."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.current: dict[str, float] = defaultdict(float)
        self._patches: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, phase: str) -> None:
        original = getattr(owner, name)
        current = self.current
        clock = self.clock

        def timed(*args, **kwargs):
            started = clock()
            try:
                return original(*args, **kwargs)
            finally:
                current[phase] += clock() - started

        self._patches.append((owner, name, original))
        setattr(owner, name, timed)

    def time_collections(self) -> None:
        """Adds the cyclic garbage collector's time to the phase "gc" (it also counts in whichever phase
        it interrupted)."""
        started: list[float] = []

        def on_collection(phase: str, info: dict) -> None:
            if phase == "start":
                started.append(self.clock())
            elif started:
                self.current["gc"] += self.clock() - started.pop()

        self._gc_callback = on_collection
        gc.callbacks.append(on_collection)

    def take(self) -> dict[str, float]:
        taken = dict(self.current)
        self.current.clear()
        return taken

    def restore(self) -> None:
        if getattr(self, "_gc_callback", None) in gc.callbacks:
            gc.callbacks.remove(self._gc_callback)
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches.clear()


def save_model(folder: Path) -> None:
    config = tiny_hf_config("LlamaForCausalLM", max_position_embeddings=4096)
    build_hf_model(config, seed=3).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SMOLLM2_TOKENIZER_DIR / name, folder / name)


def make_engine(folder: Path, batch: int, max_tokens: int) -> Engine:
    from fitserve.args import engine_args_from_kwargs
    from fitserve.planner.resolve import create_engine_config

    blocks = batch * (-(-(PROMPT_LEN + 40 + max_tokens) // BLOCK_SIZE)) + 64
    args = engine_args_from_kwargs(
        str(folder),
        {
            "dtype": "float32",
            "block_size": BLOCK_SIZE,
            "num_gpu_blocks_override": blocks,
            "max_num_seqs": batch,
            "max_num_batched_tokens": 8192,
            "max_model_len": 4096,
        },
    )
    return Engine(create_engine_config(args))


def run_batch(
    folder: Path, batch: int, steps: int, temperature: float, profile: bool, clock, settle_heap: bool
) -> dict:
    warm_steps = 10
    max_tokens = steps + warm_steps + 60
    engine = make_engine(folder, batch, max_tokens)
    # as in the engine process (engine_process_child.py), whose outputs are encoded before the next step
    engine.output_processor.share_token_lists = True
    if settle_heap:  # as the engine process does once its engine is built (engine_process_child.py)
        from fitserve.engine.engine_gc import settle_engine_heap

        settle_engine_heap()
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        length = PROMPT_LEN - 20 + (i * 7) % 41  # 580..620 tokens
        prompt = [(i * 131 + j * 17) % 250 + 3 for j in range(length)]
        engine.add_request(f"r{i}", None, prompt, params)
    phase_clock = PhaseClock(clock)
    phase_clock.time_collections()
    phase_clock.wrap(Scheduler, "schedule", "schedule")
    phase_clock.wrap(ModelRunner, "_sampling_rows", "sampling_rows")
    phase_clock.wrap(runner_module, "build_host_inputs", "host_inputs")
    phase_clock.wrap(runner_module, "upload_inputs", "upload")
    phase_clock.wrap(ModelRunner, "_forward", "forward")
    phase_clock.wrap(ModelRunner, "_sample_logits", "logits")
    phase_clock.wrap(Sampler, "launch", "sampler")
    phase_clock.wrap(ModelRunner, "launch", "launch")
    phase_clock.wrap(LaunchedStep, "result", "result")
    phase_clock.wrap(Scheduler, "update_from_output", "update")
    phase_clock.wrap(Engine, "_apply_tokens", "apply_tokens")
    phase_clock.wrap(OutputProcessor, "make_outputs", "make_outputs")
    encoder = OutputEncoder()
    rows: list[dict[str, float]] = []
    profiler = cProfile.Profile() if profile else None
    try:
        decode_steps = 0
        while decode_steps < warm_steps + steps:
            phase_clock.take()
            if profiler is not None and decode_steps >= warm_steps:
                profiler.enable()
            started = clock()
            outputs = engine.step()
            step_s = clock() - started
            started = clock()
            reply = Reply(outputs=encoder.encode(outputs), stats=engine.get_stats())
            pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
            send_s = clock() - started
            if profiler is not None:
                profiler.disable()
            phases = phase_clock.take()
            in_flight = engine._in_flight
            pure_decode = (
                in_flight is not None
                and len(in_flight.scheduler_output.scheduled) == batch
                and in_flight.scheduler_output.num_batched_tokens == batch
                and len(outputs) == batch
            )
            if not pure_decode:
                continue
            decode_steps += 1
            if decode_steps <= warm_steps:
                continue
            inner = ("sampling_rows", "host_inputs", "upload", "forward", "logits", "sampler")
            phases["launch_other"] = phases.pop("launch") - sum(phases.get(name, 0.0) for name in inner)
            # every phase but gc is timed inside step(), none inside another
            phases["step_other"] = step_s - sum(v for k, v in phases.items() if k != "gc")
            phases["send"] = send_s
            phases["host_total"] = step_s + send_s - phases.get("forward", 0.0) - phases.get("logits", 0.0)
            rows.append(phases)
    finally:
        phase_clock.restore()
    engine.abort_request([f"r{i}" for i in range(batch)])
    engine.shutdown()
    names = (*PHASES, "host_total", "forward", "logits", "gc")

    def summary(statistic) -> dict[str, float]:
        return {name: round(statistic([r.get(name, 0.0) for r in rows]) * 1e6, 1) for name in names}

    result = {
        "median_us": summary(statistics.median),
        "mean_us": summary(statistics.fmean),
        "timed_steps": len(rows),
    }
    if profiler is not None:
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime")
        result["_profile"] = stats
    return result


def summarize(out: Path) -> None:
    """Folds the runs saved in `out` whose labels are NAME_1, NAME_2, ... into summary[NAME]: per batch
    and phase, the lowest of the runs' medians (other work on a shared machine only adds time), and
    the ratio of host_total after to before."""
    saved = json.loads(out.read_text())
    groups: dict[str, list[dict]] = defaultdict(list)
    for label, run in saved["runs"].items():
        groups[label.rsplit("_", 1)[0]].append(run["per_batch"])
    summary: dict = {"how": "per phase, the lowest median of the runs of each name (us per step)"}
    for name, runs in groups.items():
        summary[name] = {
            batch: {
                phase: min(run[batch]["median_us"][phase] for run in runs)
                for phase in runs[0][batch]["median_us"]
            }
            for batch in runs[0]
        }
        summary[name]["runs"] = len(runs)
    if "before" in summary and "after" in summary:
        batches = [batch for batch in summary["before"] if batch != "runs"]
        summary["after_over_before_host_total"] = {
            batch: round(summary["after"][batch]["host_total"] / summary["before"][batch]["host_total"], 3)
            for batch in batches
        }
        # each after_i against the before_i run just before it (alternated): the median of those ratios
        runs = saved["runs"]
        pairs = [
            (runs[f"before_{i}"]["per_batch"], runs[f"after_{i}"]["per_batch"])
            for i in range(1, len(runs) + 1)
            if f"before_{i}" in runs and f"after_{i}" in runs
        ]
        summary["paired_after_over_before_host_total"] = {
            batch: {
                "median": round(
                    statistics.median(
                        a[batch]["median_us"]["host_total"] / b[batch]["median_us"]["host_total"]
                        for b, a in pairs
                    ),
                    3,
                ),
                "pairs": [
                    round(a[batch]["median_us"]["host_total"] / b[batch]["median_us"]["host_total"], 3)
                    for b, a in pairs
                ],
            }
            for batch in batches
        }
    saved["summary"] = summary
    out.write_text(json.dumps(saved, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    parser.add_argument("--label", default=None, help="the entry of --out to write (others are kept)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "cpu_host_step.json"))
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's top N (largest batch)")
    parser.add_argument(
        "--settle-heap",
        action="store_true",
        help="engine/engine_gc.settle_engine_heap() once the engine is built, as the engine process does "
        "since issue 27's work (the code before had no such function: run without)",
    )
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: the engine thread's CPU time (steadier on a shared machine); wall: perf_counter",
    )
    parser.add_argument("--summarize", action="store_true", help="fold the runs of --out (summarize)")
    args = parser.parse_args()
    if args.summarize:
        summarize(Path(args.out))
        return
    torch.set_num_threads(1)
    engine_module.logger.setLevel("WARNING")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    results = {}
    with tempfile.TemporaryDirectory(prefix="fitserve-host-step-") as tmp:
        folder = Path(tmp)
        save_model(folder)
        for batch in args.batches:
            profile = bool(args.profile) and batch == max(args.batches)
            results[str(batch)] = run_batch(
                folder, batch, args.steps, args.temperature, profile, clock, args.settle_heap
            )
            stats = results[str(batch)].pop("_profile", None)
            medians, means = results[str(batch)]["median_us"], results[str(batch)]["mean_us"]
            print(f"batch {batch}: median " + json.dumps(medians), flush=True)
            print(f"batch {batch}: mean host_total {means['host_total']}, gc {means['gc']}", flush=True)
            if stats is not None:
                stats.print_stats(args.profile)
    if args.label is None:
        return
    out = Path(args.out)
    saved = json.loads(out.read_text()) if out.exists() else {}
    saved.setdefault("machine", {})
    saved["machine"] = {
        "cpu": platform.processor() or platform.machine(),
        "cores": __import__("os").cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": 1,
    }
    saved.setdefault("runs", {})[args.label] = {
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "settle_heap": args.settle_heap,
        "clock": "thread CPU time" if args.clock == "cpu" else "wall (perf_counter)",
        "sampling": "greedy" if args.temperature == 0 else f"temperature {args.temperature}",
        "prompt_tokens": f"{PROMPT_LEN - 20}-{PROMPT_LEN + 20}",
        "per_batch": results,
    }
    out.write_text(json.dumps(saved, indent=1) + "\n")


if __name__ == "__main__":
    main()
