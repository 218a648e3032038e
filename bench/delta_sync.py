"""Sparse delta weight sync over a real RL run: how much changes, how much ships, how fast a
sampler catches up, against a full checkpoint and a full reload.

A full fine-tuning run of SmolLM2-135M-Instruct (the real pretrained model) through the tinker
SDK against `openrl serve`: an arithmetic task ("12+7=" -> the sum), a group of samples per
prompt, reward 1 for the right number, group-centred advantages, importance_sampling, AdamW
(lr 1e-5), and after every step `save_weights_and_get_sampling_client`, which publishes the
weights to the sampler in bfloat16 as a sparse delta (or a full checkpoint). Reported at steps
1, 10 and 40 (and every step in --json): the share of bf16 elements that changed, the bytes
shipped against a full bf16 checkpoint, and the sampler's update time (applying that delta in
place) against a full reload of the same version, both measured here side by side on the
published files (each the median of several alternating repetitions).

    .venv/bin/python bench/delta_sync.py [--steps 40] [--model HuggingFaceTB/SmolLM2-135M-Instruct]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

KEYS = "alice=tml-bench-alice"
REPORT_AT = (1, 2, 10, 40)


def published_chain(data_dir: Path) -> list[dict]:
    """Every save_weights_for_sampler completion's publication details, in order."""
    from sqlalchemy import create_engine, select

    from eventing.store import tables

    engine = create_engine(f"sqlite:///{data_dir / 'events.db'}")
    with engine.connect() as conn:
        rows = conn.execute(
            select(tables.events.c.data)
            .where(tables.events.c.type.contains("save_weights_for_sampler.completed"))
            .order_by(tables.events.c.position)
        ).all()
    engine.dispose()
    out = []
    for (data,) in rows:
        completed = json.loads(data)
        details = (completed.get("details") or {}).get("publication")
        manifest = (completed.get("sampling_session") or {}).get("weights")
        if details and manifest:
            out.append({**details, "manifest": manifest})
    return out


def time_updates(
    model_name: str, data_dir: Path, chain: list[dict], steps: list[int], repeats: int = 5
) -> dict[int, dict]:
    """For each step s, the sampler's two ways from version s-1 to s, side by side: apply the
    published delta in place (`Receiver.update`: fetch the delta from the blob store, check
    the base, scatter, verify the checksum), and a full reload (`Receiver.load_full`: fetch
    the full bf16 checkpoint of version s from the blob store, verify it, copy it in)."""
    import torch
    from safetensors.torch import save as save_safetensors

    from eventing.blobs import BlobStore
    from functions.compute.models import ModelDirectory, load_causal_lm
    from functions.compute.weight_sync import Link, Receiver, read_manifest
    from openrl_core import delta
    from openrl_core.events.lifecycle import BlobRef

    blobs = BlobStore(data_dir / "blobs")
    fetch = lambda ref: blobs.get("alice", ref)  # noqa: E731
    files = ModelDirectory(Catalog_for(model_name)).files(model_name)
    model = load_causal_lm(files)
    params = dict(model.named_parameters())
    receiver = Receiver(params, "bfloat16")
    out = {}
    for step in steps:
        if step < 2 or step >= len(chain) or chain[step]["kind"] != "delta":
            continue
        before, after = (read_manifest(fetch(BlobRef(**chain[i]["manifest"]))) for i in (step - 1, step))
        receiver.update(after, fetch)
        bits = {k: p.detach().to(torch.bfloat16) for k, p in params.items()}
        full_ref = blobs.put("alice", save_safetensors(bits))  # what a full publication of `step` would be
        full_link = Link(after["version"], "full", None, None, after["chain"][-1].checksum, full_ref, 0, 0)
        assert full_link.checksum == delta.checksum(
            {k: v.view(torch.int16).numpy().view("uint16") for k, v in bits.items()}
        )
        delta_times, reload_times = [], []
        for _ in range(repeats):
            receiver.version = None
            receiver.update(before, fetch)  # hold step - 1
            started = time.perf_counter()
            receiver.update(after, fetch)
            delta_times.append(time.perf_counter() - started)
            assert receiver.last_update["kind"] == "delta"
            receiver.version = None
            receiver.update(before, fetch)
            started = time.perf_counter()
            receiver.load_full(fetch(full_ref), full_link)
            reload_times.append(time.perf_counter() - started)
        out[step] = {"delta_seconds": statistics.median(delta_times), "reload_seconds": statistics.median(reload_times)}
    return out


def Catalog_for(model_name: str):
    from openrl_core.catalog import Catalog

    return Catalog.from_names([model_name])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    import tinker
    from tinker import types

    from functions.local_server import LocalServer

    data_dir = Path(tempfile.mkdtemp(prefix="openrl-delta-bench-"))
    env = {"OPENRL_SNAPSHOT_EVERY_STEPS": "0", "OPENRL_DELTA_FULL_EVERY": "0"}
    server = LocalServer(data_dir, [args.model], KEYS, extra_env=env).wait_ready()
    rng = np.random.default_rng(0)
    rewards = []
    try:
        service = tinker.ServiceClient(base_url=server.url, api_key="tml-bench-alice")
        training = service.create_lora_training_client(
            base_model=args.model, user_metadata={"openrl.full_finetune": "true"}
        ).result()
        tokenizer = training.get_tokenizer()
        sampler = training.save_weights_and_get_sampling_client().result()
        started = time.perf_counter()
        for step in range(1, args.steps + 1):
            problems = [(int(a), int(b)) for a, b in rng.integers(1, 20, size=(args.prompts, 2))]
            prompts = [tokenizer.encode(f"{a}+{b}=") for a, b in problems]
            futures = [sampler.sample(types.ModelInput.from_ints(p), num_samples=args.group,
                                      sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=step * 100 + i))
                       for i, p in enumerate(prompts)]  # fmt: skip
            data, step_rewards = [], []
            for (a, b), prompt, future in zip(problems, prompts, futures):
                sequences = future.result().sequences
                group = [1.0 if tokenizer.decode(s.tokens).strip().startswith(str(a + b)) else 0.0 for s in sequences]
                baseline = sum(group) / len(group)
                step_rewards += group
                for seq, reward in zip(sequences, group):
                    tokens = prompt + seq.tokens
                    n, ob = len(tokens) - 1, len(prompt) - 1
                    data.append(types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": ([0.0] * ob + list(seq.logprobs))[:n],
                                        "advantages": ([0.0] * ob + [reward - baseline] * len(seq.tokens))[:n]}))  # fmt: skip
            training.forward_backward(data, "importance_sampling").result()
            training.optim_step(types.AdamParams(learning_rate=args.lr)).result()
            sampler = training.save_weights_and_get_sampling_client().result()
            rewards.append(float(np.mean(step_rewards)))
            print(
                f"step {step}/{args.steps}: reward {rewards[-1]:.3f}  ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
        service.close("success").result()
    finally:
        server.stop()

    chain = published_chain(data_dir)  # chain[0] is the publication before any step
    steps = [s for s in REPORT_AT if s < len(chain)]
    timings = time_updates(args.model, data_dir, chain, steps)
    print(
        f"\n{args.model}, full fine-tuning, AdamW lr {args.lr}, {args.prompts} prompts x {args.group} samples per step"
    )
    print(
        f"{'step':>5} {'kind':>6} {'changed':>9} {'bytes shipped':>14} {'of full bf16':>13} {'delta apply':>12} {'full reload':>12} {'ratio':>7}"
    )
    for step in steps:
        p = chain[step]
        t = timings.get(step, {})
        ratio = f"{t['delta_seconds'] / t['reload_seconds']:.3f}" if t else "-"
        print(f"{step:>5} {p['kind']:>6} {p['changed'] / p['elements']:>9.2%} {p['file_bytes']:>14,} {p['file_bytes'] / p['full_bytes']:>13.2%} "
              f"{t.get('delta_seconds', float('nan')) * 1000:>10.1f}ms {t.get('reload_seconds', float('nan')) * 1000:>10.1f}ms {ratio:>7}")  # fmt: skip
    print(f"reward: first 5 steps {np.mean(rewards[:5]):.3f}, last 5 {np.mean(rewards[-5:]):.3f}")
    if args.json:
        args.json.write_text(
            json.dumps({"chain": chain, "timings": timings, "rewards": rewards}, indent=2, default=str)
        )


if __name__ == "__main__":
    main()
