"""The harness that tests and benchmarks share, and that users may script a local pagedserve with in their
own tests: it is product code, documented and kept working like any other module, not a test.

- server_harness.py: `running_server(tmp_dir, *serve_flags)`, a real `pagedserve serve` on a free loopback
  port, ready when it yields and proven cleanly stopped when the block ends; `running_gateway`, `http_json`.
- tiny_models.py: `make_tiny_model(tmp_dir, arch)`, a tiny random Hugging Face checkpoint (config.json +
  safetensors) for token-exact comparisons without a download.
- hf_reference.py: transformers' answers (float32 greedy tokens, logits, bf16 prefill), the correctness
  oracle. Needs `transformers`.
- paged_runner.py and attention_cases.py: a loop-based driver of a model through a paged KV cache, and
  NaN-poisoned paged-attention cases, for kernel and model checks.

Imports torch, transformers or the services only in the modules that need them: importing the package is
cheap. Nothing below the top floor imports this package, and it never imports tests/.
"""
