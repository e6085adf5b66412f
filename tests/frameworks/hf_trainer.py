"""A Hugging Face ``Trainer`` script as its documentation writes one; nothing of Resurgo.

A tiny GPT-2 built from a config trains on random tokens (nothing is downloaded),
saves ``checkpoint-N/`` every ``--save-steps``, and resumes the way the docs
show: ``trainer.train(resume_from_checkpoint=get_last_checkpoint(out))``.
Under torchrun it runs DDP on gloo. Each step is printed with its loss and wall
time, so a test can compute the run's real progress from this log alone.

``--nan-at-step N`` makes the loss NaN at step N (the first time only, by a
marker file in the output directory): the kind of fault a user's data causes.
``--abort-at-exit-rank R``: rank R dies by SIGABRT after training ended, as a
crash in gloo's or CUDA's teardown does.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint


class RandomTokens(Dataset):  # type: ignore[type-arg]
    def __init__(self, count: int, length: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.tokens = torch.randint(0, vocab, (count, length), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


class StepLog(TrainerCallback):
    """One line per optimizer step: ``step N loss L t T`` (rank 0)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(self.delay_s)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step {state.global_step} loss {logs['loss']:.4f} t {time.time():.3f}",
                  flush=True)  # fmt: skip


class NanOnce(TrainerCallback):
    """Make the loss NaN at one step, once (a marker file remembers across restarts)."""

    def __init__(self, model: torch.nn.Module, step: int | None, marker: Path) -> None:
        self.step, self.marker, self.now = step, marker, 0
        model.lm_head.register_forward_hook(self.poison)

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.now = state.global_step + 1
        return control

    def poison(self, module, inputs, output):  # type: ignore[no-untyped-def]
        if self.step is None or self.now != self.step or self.marker.exists():
            return output
        if int(os.environ.get("RANK", "0")) == 0:
            self.marker.touch()
        return output * float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--save-steps", type=int, default=20)
    parser.add_argument("--step-s", type=float, default=0.0, help="extra time per step")
    parser.add_argument("--nan-at-step", type=int, default=None)
    parser.add_argument(
        "--abort-at-exit-rank", type=int, default=None, help="this rank aborts after training"
    )
    args = parser.parse_args()

    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32)
    model = GPT2LMHeadModel(config)
    nan = NanOnce(model, args.nan_at_step, Path(args.out) / "nan-injected")
    training_args = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        save_steps=args.save_steps,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,  # its carriage returns would run into the step lines
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=RandomTokens(4096, 32, config.vocab_size),
        callbacks=[StepLog(args.step_s), nan],
    )
    last = get_last_checkpoint(args.out) if os.path.isdir(args.out) else None
    print(f"resume from {last}", flush=True)
    trainer.train(resume_from_checkpoint=last)
    print(f"rank {os.environ.get('RANK', '0')} finished training", flush=True)
    if args.abort_at_exit_rank is not None and int(os.environ.get("RANK", "0")) == (
        args.abort_at_exit_rank
    ):
        time.sleep(1.0)  # its peers exit 0 first, or at the same time
        os.abort()


if __name__ == "__main__":
    main()
