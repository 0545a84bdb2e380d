"""`fitserve bench`: serve (an OpenAI-compatible server, over HTTP), throughput and latency (offline).

serve: datasets.py (prompts) -> client.py (one streamed, timed request) -> serve.py (arrivals,
concurrency, the run) -> metrics.py (pure arithmetic) -> report.py (table, JSON) / plot.py (PNG).
throughput / latency: workloads.py -> fitserve's `LLM` in this process. cli_bench.py holds the parsers.
"""
