"""A DeepSpeed script as its documentation writes one; nothing of Resurgo.

A tiny language model trains on random tokens on the CPU (DeepSpeed picks its
CPU accelerator, gloo between the ranks), saves with
``engine.save_checkpoint(out)`` every ``--save-steps`` (``global_stepN/`` and
the ``latest`` file naming the newest tag) and resumes the way the docs show:
``engine.load_checkpoint(out)`` at the start, which reads ``latest``. Each step
is printed with its loss and wall time (rank 0), as the other framework
scripts do.
"""

from __future__ import annotations

import argparse
import os
import time

import deepspeed
import torch


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 128, width: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.mix = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.mix(self.embed(tokens[:, :-1]))))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--save-steps", type=int, default=20)
    parser.add_argument("--step-s", type=float, default=0.0, help="extra time per step")
    args = parser.parse_args()

    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        # Stage 0: the optimizer's state is whole in each checkpoint, so a relaunch on
        # fewer nodes loads it (stage 1's is split per data-parallel rank).
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
    }
    model = TinyLM()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    loaded, _ = engine.load_checkpoint(args.out) if os.path.isdir(args.out) else (None, None)
    print(f"resume from {loaded}", flush=True)
    rank = int(os.environ.get("RANK", "0"))
    generator = torch.Generator().manual_seed(1234 + rank)
    while engine.global_steps < args.steps:
        tokens = torch.randint(0, 128, (4, 32), generator=generator)
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        step = engine.global_steps
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f} t {time.time():.3f}", flush=True)
        time.sleep(args.step_s)
        if step % args.save_steps == 0:
            engine.save_checkpoint(args.out)
    print(f"rank {rank} finished training", flush=True)


if __name__ == "__main__":
    main()
