"""ServerMetrics' per-request histograms from a request's cumulative outputs, read back from /metrics text."""

from __future__ import annotations

from types import SimpleNamespace

from fitserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from fitserve.server.metrics import ServerMetrics, buckets_1_2_5


def _output(tokens: int, finished: bool, timing: RequestMetrics) -> RequestOutput:
    choice = CompletionOutput(0, "", list(range(tokens)), None, None, "length" if finished else None)
    return RequestOutput("r1", None, [1, 2, 3], [choice], finished, metrics=timing)


def _sample(text: str, name: str) -> float:
    line = next(
        line for line in text.splitlines() if line.startswith(f'vllm:{name}{{engine="0",model_name="m"}}')
    )
    return float(line.rsplit(" ", 1)[1])


def test_each_generated_token_after_the_first_is_one_inter_token_observation() -> None:
    metrics = ServerMetrics("m", lambda: None, max_model_len=100)
    timing = RequestMetrics(
        arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, max_tokens_param=8
    )
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
    assert _sample(text, "request_prefill_time_seconds_sum") == 0.5
    assert _sample(text, "request_decode_time_seconds_sum") == 1.5
    assert _sample(text, "request_inference_time_seconds_sum") == 2.0
    assert _sample(text, "time_per_output_token_seconds_count") == 3
    assert _sample(text, "request_params_max_tokens_sum") == 8
    assert _sample(text, "request_params_n_sum") == 1
    assert _sample(text, "request_max_num_generation_tokens_sum") == 4
    assert _sample(text, "request_generation_tokens_sum") == 4
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 1.0' in text
    assert 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 0.0' in text
    # vLLM's 1-2-5 token buckets stop at max_model_len
    assert 'vllm:request_prompt_tokens_bucket{engine="0",le="100.0",model_name="m"} 1.0' in text
    assert 'le="200.0"' not in text


def test_buckets_1_2_5() -> None:
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(2048)[-1] == 2000


def test_iteration_tokens_and_cache_config_info() -> None:
    stats = SimpleNamespace(iteration_tokens_counts=(2, 1) + (0,) * 11 + (1,), iteration_tokens_sum=30000)
    cache = {"block_size": "16", "num_gpu_blocks": "100"}
    text = ServerMetrics("m", lambda: stats, cache_info=cache).render()[0].decode()
    assert "# TYPE vllm:iteration_tokens_total histogram" in text
    assert 'vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="m"} 2.0' in text
    assert 'vllm:iteration_tokens_total_bucket{engine="0",le="8.0",model_name="m"} 3.0' in text
    assert 'vllm:iteration_tokens_total_bucket{engine="0",le="16384.0",model_name="m"} 3.0' in text
    assert 'vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="m"} 4.0' in text
    assert 'vllm:iteration_tokens_total_count{engine="0",model_name="m"} 4.0' in text
    assert 'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0' in text
