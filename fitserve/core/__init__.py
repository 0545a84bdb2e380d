"""The types the engine and the worker share: requests, sampling parameters, outputs, the scheduler and
the KV block bookkeeping (its `SchedulerOutput` is the one contract between them). Plain Python and
dataclasses: nothing here imports a device, a model or the engine."""
