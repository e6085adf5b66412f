"""A PyTorch Lightning script as its documentation writes one; nothing of Resurgo.

A tiny language model trains on random tokens, ``ModelCheckpoint`` saves every
``--save-steps`` (each ``step=N.ckpt`` kept, plus ``last.ckpt``) and the run
resumes the way the docs show: ``trainer.fit(model, data, ckpt_path="last")``.
Under torchrun, Lightning picks the torchelastic environment; ``num_nodes``
comes from the world torchrun made. Each step is printed with its loss and
wall time (rank 0).

``--nan-at-step N`` makes the loss NaN at step N, the first time only.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class TinyLM(L.LightningModule):
    def __init__(self, vocab: int = 128, width: int = 32, step_s: float = 0.0,
                 nan_at: int | None = None, marker: str = "") -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        self.embed = torch.nn.Embedding(vocab, width)
        self.mix = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        (tokens,) = batch
        logits = self.head(torch.tanh(self.mix(self.embed(tokens[:, :-1]))))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        step = self.global_step + 1
        marker = Path(self.hparams.marker)
        if self.hparams.nan_at == step and not marker.exists():
            if self.global_rank == 0:
                marker.touch()
            loss = loss * float("nan")
        if self.global_rank == 0:
            print(f"step {step} loss {loss.item():.4f} t {time.time():.3f}", flush=True)
        time.sleep(self.hparams.step_s)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--save-steps", type=int, default=20)
    parser.add_argument("--step-s", type=float, default=0.0, help="extra time per step")
    parser.add_argument("--nan-at-step", type=int, default=None)
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(1234)
    data = DataLoader(TensorDataset(torch.randint(0, 128, (4096, 32), generator=generator)),
                      batch_size=4, shuffle=True)  # fmt: skip
    model = TinyLM(step_s=args.step_s, nan_at=args.nan_at_step,
                   marker=str(Path(args.out) / "nan-injected"))  # fmt: skip
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    checkpoints = ModelCheckpoint(
        dirpath=args.out, filename="{step}", every_n_train_steps=args.save_steps,
        save_top_k=-1, save_last=True,
    )  # fmt: skip
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=per_node,
        num_nodes=world // per_node,
        strategy="ddp" if world > 1 else "auto",
        callbacks=[checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
    )
    trainer.fit(model, data, ckpt_path="last")


if __name__ == "__main__":
    main()
