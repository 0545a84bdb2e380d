"""Fit the model to the machine before loading it: hardware probes, weight sizes from file headers, the
memory plan (a pure function), auto-fit with its reasons and refusals, and `fitserve plan` / `doctor`.
docs/memory.md explains every number."""
