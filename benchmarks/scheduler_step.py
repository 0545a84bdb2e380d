"""The scheduler's host time per decode step of 256 running requests: schedule() + update_from_output().

No model: every request has a 512-token prompt computed by the first steps, then each step plans one token
per request and appends a sampled one (block size 16, prefix caching on, so blocks fill and are hashed
as they would be). Prints the median and the mean of the timed steps in microseconds, as JSON.

    python benchmarks/scheduler_step.py [--groups] [--steps 400]

--groups: the same batch over a HybridKVCacheManager with a full group and a sliding group (window 1024),
what a Gemma-4-like model runs; without it, the single-group KVCacheManager every other model runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from fitserve.config import SchedulerConfig
from fitserve.core.kv_cache import KVCacheManager
from fitserve.core.request import Request
from fitserve.core.sampling_params import SamplingParams
from fitserve.core.scheduler import Scheduler

NUM_REQUESTS, PROMPT, BLOCK_SIZE = 256, 512, 16


def make_scheduler(groups: bool) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=NUM_REQUESTS, max_num_batched_tokens=8192, max_model_len=4096)
    num_blocks = NUM_REQUESTS * (4096 // BLOCK_SIZE) + 1
    if groups:
        from fitserve.core.kv_cache_groups import HybridKVCacheManager
        from fitserve.kv_groups import KvCacheGroup

        kv_groups = (KvCacheGroup(None, (5,), 1, 256), KvCacheGroup(1024, (0,), 1, 130))
        manager = HybridKVCacheManager(kv_groups, (num_blocks, NUM_REQUESTS * 130 + 1), BLOCK_SIZE, True)
    else:
        manager = KVCacheManager(num_blocks, BLOCK_SIZE, True)
    return Scheduler(config, manager)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", action="store_true")
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    scheduler = make_scheduler(args.groups)
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for i in range(NUM_REQUESTS):
        prompt = [(i * 7919 + j) % 50_000 for j in range(PROMPT)]
        scheduler.add_request(Request(str(i), str(i), 0, prompt, params, frozenset()))
    token = 0
    times = []
    for step in range(args.steps + 40):
        started = time.perf_counter()
        out = scheduler.schedule()
        sampled = {item.request.request_id: token for item in out.scheduled if item.samples}
        scheduler.update_from_output(out, sampled)
        elapsed = time.perf_counter() - started
        token = (token + 1) % 50_000
        if step >= 40:  # every prompt is computed by then: a decode step of 256 requests
            assert len(out.scheduled) == NUM_REQUESTS and out.num_batched_tokens == NUM_REQUESTS
            times.append(elapsed * 1e6)
    result = {
        "groups": args.groups,
        "median_us": round(statistics.median(times), 1),
        "mean_us": round(statistics.fmean(times), 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
