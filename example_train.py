"""The seed's scenario on synthetic data: a siamese pairwise "winner" model with telemetry.

Two images go through a shared backbone; a head reads both embeddings and predicts which one wins
(winner 0 or 1). The backbone trains at 1x and the head at 10x the learning rate, in two named param
groups. Scenarios plant the problems telemetry is for:

    python example_train.py                          # healthy, writes runs/healthy
    python example_train.py --scenario overfit       # tiny train set: train acc climbs, holdout ~50%
    python example_train.py --scenario frozen_backbone | imbalanced | exploding | zero_grad_first
    python analyze_telemetry.py runs/healthy
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

from telemetry import TelemetryConfig, TrainingTelemetry

SCENARIOS = {
    "healthy": dict(train_pairs=4096, epochs=3),
    # One batch an epoch, so batch_idx is always 1: collect at every batch to see anything.
    "overfit": dict(train_pairs=16, epochs=150, batch_size=16, collect_every_n=1),
    "frozen_backbone": dict(train_pairs=4096, epochs=3, backbone_lr=0.0),
    "imbalanced": dict(train_pairs=4096, epochs=3, winner_one_share=0.9),
    "exploding": dict(train_pairs=4096, epochs=3, backbone_lr=5.0, head_lr=50.0),
    "zero_grad_first": dict(train_pairs=4096, epochs=3),
}
IMAGE_DIM = 256


class SiameseWinner(nn.Module):
    def __init__(self, dim: int = IMAGE_DIM, hidden: int = 128, embed: int = 64):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(0.1),
                                      nn.Linear(hidden, embed), nn.ReLU())
        self.head = nn.Linear(2 * embed, 2)

    def forward(self, img1: torch.Tensor, img2: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.backbone(img1), self.backbone(img2)], dim=-1))


def make_pairs(n: int, generator: torch.Generator, direction: torch.Tensor, winner_one_share: float = 0.5):
    """Pairs of random "images"; the winner is the image with the larger hidden score direction . x."""
    img1 = torch.randn(n, IMAGE_DIM, generator=generator)
    img2 = torch.randn(n, IMAGE_DIM, generator=generator)
    winner = (img2 @ direction > img1 @ direction).long()
    if winner_one_share != 0.5:  # resample pairs until the label shares are as asked
        want_one = torch.rand(n, generator=generator) < winner_one_share
        swap = winner.bool() != want_one
        img1[swap], img2[swap] = img2[swap].clone(), img1[swap].clone()
        winner = want_one.long()
    return {"img1": img1, "img2": img2, "winner": winner}


def batches(data, batch_size: int, generator: torch.Generator):
    order = torch.randperm(len(data["winner"]), generator=generator)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        yield {k: v[idx] for k, v in data.items()}


def train(scenario: str = "healthy", out: str = None, config_path: str = "telemetry.yaml",
          collect_every_n: int = None, seed: int = 0, telemetry_on: bool = True, epochs: int = None,
          quiet: bool = False) -> nn.Module:
    spec = {"train_pairs": 4096, "epochs": 3, "batch_size": 32, "backbone_lr": 1e-3, "head_lr": 1e-2,
            "winner_one_share": 0.5, **SCENARIOS[scenario]}
    if epochs is not None:
        spec["epochs"] = epochs
    torch.manual_seed(seed)
    data_gen = torch.Generator().manual_seed(1234)
    direction = torch.randn(IMAGE_DIM, generator=data_gen)
    train_set = make_pairs(spec["train_pairs"], data_gen, direction, spec["winner_one_share"])
    val_set = make_pairs(512, data_gen, direction)

    model = SiameseWinner()
    optimizer = torch.optim.AdamW([
        {"params": model.backbone.parameters(), "lr": spec["backbone_lr"], "name": "backbone"},
        {"params": model.head.parameters(), "lr": spec["head_lr"], "name": "head"},
    ], weight_decay=0.01)

    telemetry = None
    if telemetry_on:
        overrides = {"output_dir": out or os.path.join("runs", scenario)}
        if collect_every_n or spec.get("collect_every_n"):
            overrides["collect_every_n"] = collect_every_n or spec["collect_every_n"]
        telemetry = TrainingTelemetry(TelemetryConfig.from_yaml(config_path, **overrides))
        telemetry.set_holdout_data(batches(val_set, 32, torch.Generator().manual_seed(0)))

    loss_fn = nn.CrossEntropyLoss()
    shuffle = torch.Generator().manual_seed(seed)
    started = time.time()
    for epoch in range(spec["epochs"]):
        for batch_idx, batch in enumerate(batches(train_set, spec["batch_size"], shuffle), 1):
            model.train()
            logits = model(batch["img1"], batch["img2"])
            loss = loss_fn(logits, batch["winner"])
            if scenario == "zero_grad_first":
                optimizer.zero_grad()  # the bug this scenario plants: gradients are gone before the hook
            loss.backward()
            optimizer.step()
            if scenario == "zero_grad_first":
                optimizer.zero_grad()
            if telemetry:
                train_acc = (logits.argmax(-1) == batch["winner"]).float().mean()
                telemetry.on_batch_end(model, optimizer, batch_idx, epoch, batch=batch, loss=loss,
                                       train_acc=train_acc)
            optimizer.zero_grad()
        if not quiet:
            print(f"epoch {epoch}: last loss {loss.item():.4f}", file=sys.stderr)
    if telemetry:
        telemetry.close()
        if not quiet:
            print(f"trained {scenario!r} in {time.time() - started:.1f}s; run directory: {telemetry.output_dir}")
            print(f"analyze it with: python analyze_telemetry.py {telemetry.output_dir}")
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="healthy")
    parser.add_argument("--out", help="run directory (default runs/<scenario>)")
    parser.add_argument("--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                         "telemetry.yaml"))
    parser.add_argument("--collect-every-n", type=int, help="override collect_every_n from the config")
    parser.add_argument("--epochs", type=int, help="override the scenario's number of epochs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train(args.scenario, args.out, args.config, args.collect_every_n, args.seed, epochs=args.epochs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
