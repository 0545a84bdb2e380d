"""The engine process's garbage collector, set once its engine is built (engine_process_child.py).

Two costs on the step path of a busy engine process (benchmarks/host_step.py, 256 decoding requests on the
2-core development CPU):
- Full collections walked the ~400,000 objects the start left (torch's and transformers' modules, the model,
  the tokenizer): 128 ms each, the engine holding the GIL meanwhile, several per minute of serving. The
  server process freezes its own startup heap (server/api_server.freeze_startup_heap); the engine process
  now does the same, so a full collection walks only what requests made since.
- Young-generation collections: a decode step of 256 requests keeps ~2,000 new container objects alive
  for a step (the scheduled rows, the outputs until they are sent), more than the default threshold of
  700, so the collector walked them several times a step (0.4-0.5 ms a step). With a threshold of
  ENGINE_GC_THRESHOLD, objects that die within a step or two are freed by their reference counts before
  any collection looks at them; cycles are still collected, a little later.
"""

from __future__ import annotations

import gc

ENGINE_GC_THRESHOLD = 20_000


def settle_engine_heap() -> None:
    """One collection of the start's garbage, then its survivors out of the collector's reach, and a
    young-generation threshold for a step's worth of live objects. Call once the engine is built."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(ENGINE_GC_THRESHOLD, older, oldest)
