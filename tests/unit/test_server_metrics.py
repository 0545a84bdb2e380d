"""ServerMetrics' per-request histograms from a request's cumulative outputs, read back from /metrics text."""

from __future__ import annotations

from fitserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from fitserve.server.metrics import ServerMetrics


def _output(tokens: int, finished: bool, timing: RequestMetrics) -> RequestOutput:
    choice = CompletionOutput(0, "", list(range(tokens)), None, None, "length" if finished else None)
    return RequestOutput("r1", None, [1, 2, 3], [choice], finished, metrics=timing)


def _sample(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(f'fitserve:{name}{{model_name="m"}}'))
    return float(line.rsplit(" ", 1)[1])


def test_each_generated_token_after_the_first_is_one_inter_token_observation() -> None:
    metrics = ServerMetrics("m", lambda: None)
    timing = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0)
    timing.last_token_time = 11.0
    metrics.observe(_output(1, False, timing))
    timing.last_token_time = 12.0
    metrics.observe(_output(3, False, timing))  # two tokens in one output: 0.5 s apart each
    timing.last_token_time, timing.finished_time = 12.5, 12.5
    metrics.observe(_output(4, True, timing))
    text = metrics.render()[0].decode()
    assert _sample(text, "time_to_first_token_seconds_sum") == 1.0
    assert _sample(text, "inter_token_latency_seconds_count") == 3
    assert _sample(text, "inter_token_latency_seconds_sum") == 1.5
    assert _sample(text, "e2e_request_latency_seconds_sum") == 2.5
    assert _sample(text, "request_queue_time_seconds_sum") == 0.5
    assert _sample(text, "request_generation_tokens_sum") == 4
    assert 'fitserve:request_success_total{finished_reason="length",model_name="m"} 1.0' in text
