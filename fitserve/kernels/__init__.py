"""GPU kernels (Triton; one in Gluon, Triton's lower-level dialect) and the torch reference each one is
tested against. The layers call them (the CUDA attention backend is
fitserve/layers/attention/triton_backend.py); nothing here imports the layers.

`reference`, `kv_format` (how the KV cache stores keys and values, float8 included), `attention_inputs` and
`capability` (the compute capability the config choosers go by, FITSERVE_KERNEL_TARGET to force one, and
each GPU generation's shared memory a block) and `split_counters` (the split-K kernels' arrival counters) are
plain torch and import on any machine. `variants` compiles
every kernel variant the launchers pick for sm_70 to sm_90 without a GPU and checks it fits
(tests/unit/test_kernel_targets.py). Every other module here imports triton at import time, so only
CUDA code paths may import them (fitserve never imports this package's Triton modules on a CPU-only
machine):

| module | kernel | reference |
| --- | --- | --- |
| `cache_write` | `reshape_and_cache` | `reshape_and_cache_reference` |
| `decode_attention` | `paged_decode_attention` (split-K, merged; windows) | `paged_attention_reference` |
| `prefill_attention` | `paged_prefill_attention` (varlen, causal; windows) | `paged_attention_reference` |
| `prefill_attention_sm90` | `paged_prefill_attention_sm90` (Gluon; sm_90) | `paged_attention_reference` |
| `norm` | `rms_norm`, `fused_add_rms_norm` | `rms_norm_reference`, `fused_add_rms_norm_reference` |
| `norm` | `gemma_rms_norm`, `gemma_norm_add` (Gemma-4) | `GemmaRMSNorm` and the layer's torch path |
| `rotary` | `rotary_embedding` (neox, in place) | `rotary_embedding_reference` |
| `rotary_cache_write` | `rotary_cache_write` (+ q/k RMSNorm) | `rotary_embedding_reference`, then the write |
| `activation` | `silu_and_mul` | `silu_and_mul_reference` |
| `activation` | `gelu_tanh_and_mul`, `gelu_tanh_mul` (Gemma-4) | torch's gelu (tanh) |
| `fused_moe` | `fused_moe` (routing, gate_up + act, down x weight, sum) | `FusedExperts.reference` |
| `moe_decode` | `moe_decode` (1-8 tokens in two kernels; shared expert) | `FusedExperts.reference` |
| `skinny_gemm` | `skinny_gemm` (1 to 16 rows; `l2_prefetch` asks for its weight rows early) | `F.linear` |
| `skinny_split_gemm` | `skinny_split_gemm` (1 to 16 rows, N <= 2,048: split over K) | `F.linear` |
| `swapped_gemm` | `swapped_gemm` (17 to 32 rows: y.T = W x.T) | `F.linear` |
| `argmax` | `argmax_rows` (greedy sampling) | `torch.argmax` |
| `graph_inputs` | `stage_decode_inputs` | `CudaGraphRunner.copy_inputs_torch` |
| `gated_delta_chunk` | `chunk_gated_delta_rule_kernel` (prefill) | `chunk_gated_delta_rule` (*) |
| `gated_delta_recurrent` | `fused_recurrent_gated_delta_rule_kernel` | `recurrent_gated_delta_rule` (*) |
| `causal_conv1d` | `causal_conv1d_varlen`, `causal_conv1d_update` | `causal_conv1d(_step)` (*) |

(*) in fitserve/layers/gated_delta_rule.py (Gated DeltaNet, whose CUDA branch calls these kernels).
"""
