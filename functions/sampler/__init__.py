"""The torch sampling engine: token ids in, sampled token ids and their logprobs out.

The engine knows nothing about HTTP, events or the Tinker wire format; it takes
`SampleJob`s (a prompt as token ids, `SamplingParams`, how many samples, which adapter)
and returns one `SampleResult` per job. Text appears only where stop strings need it.

- `types`: the job and result dataclasses the worker builds and reads.
- `processing`: pure tensor functions (temperature, top-k, top-p, inverse-CDF sampling,
  raw logprobs), testable without a model.
- `stops`: per-row stop detection (stop token ids, EOS, stop strings on a decoded tail).
- `engine`: `SamplerEngine`, the model, its LoRA adapters and the batched KV-cache loop.
- `vllm_engine`: `VllmEngine`, the same interface over vLLM running in a child process from
  its own virtualenv (`make vllm`); `vllm_server` is that child (stdlib and vLLM only).
"""
