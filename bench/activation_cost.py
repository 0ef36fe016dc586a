"""What the activation check (track_activations: dead ReLU units, saturated sigmoid/tanh outputs) costs.

    python bench/activation_cost.py [--repeats 30] [--holdout 256]

On collecting steps the check watches the holdout's forward pass through forward hooks on the activation
modules, so it costs something there: this times whole collections (on_batch_end on a collecting step) of
two TrainingTelemetry instances on the same model, one with track_activations on and one with it off,
alternated, and prints the median of each and their ratio. Steps that do not collect must pay nothing: the
hooks are put on for the holdout's forward only, so this also times on_batch_end on the steps that do not
collect and the training steps between collections with each instance, and counts the forward hooks on the
model during training (0 expected). Two models: an MLP and a small CNN, both ReLU, on random data of
MNIST's shape. Ratios are measured side by side in one run; absolute times depend on the machine.

The figures measured on this project's machine are in bench/RESULTS.md, with this command.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from telemetry import TelemetryConfig, TrainingTelemetry  # noqa: E402

EVERY = 10   # collect_every_n: batch_idx 10, 20, ... collect, the others do not


def models():
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                        nn.Linear(512, 10))
    cnn = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 14 * 14, 10))
    return {"MLP 784-512-512-10": mlp, "CNN 16-32 channels": cnn}


def hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def train_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


def measure(name, model, holdout: int, repeats: int, root: str) -> dict:
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    hx, hy = torch.randn(holdout, 1, 28, 28), torch.randint(0, 10, (holdout,))
    tels = {}
    for on in (True, False):
        tel = TrainingTelemetry(TelemetryConfig(output_dir=os.path.join(root, f"{name[:3]}-{on}"), collect_every_n=EVERY,
                                                holdout_size=holdout, track_activations=on, track_system=False,
                                                alerts=False))
        tel.set_holdout_data((hx, hy))
        tels[on] = tel
    collect = {True: [], False: []}   # seconds per collecting on_batch_end
    skip = {True: [], False: []}      # seconds per non-collecting on_batch_end
    train = {True: [], False: []}     # seconds per training step (forward, backward, step) between them
    hooks_in_training = 0
    for i in range(repeats + 2):   # the first two rounds warm up (the first collection writes W_0)
        for on in (True, False):   # alternated, so that drift in the machine's load hits both alike
            tel = tels[on]
            for b in range(1, EVERY + 1):
                started = time.perf_counter()
                train_step(model, optimizer, x, y)
                trained = time.perf_counter()
                hooks_in_training += hooks(model)
                rec = tel.on_batch_end(model, optimizer, i * EVERY + b, 0, batch=(x, y))
                done = time.perf_counter()
                if i >= 2:
                    (collect if b == EVERY else skip)[on].append(done - trained)
                    train[on].append(trained - started)
                assert (rec is not None) == (b == EVERY) and (rec is None or ("activations" in rec) == on)
    for tel in tels.values():
        tel.close()
    out = {"hooks_in_training": hooks_in_training}
    for key, times in (("collect", collect), ("skip", skip), ("train", train)):
        for on in (True, False):
            out[f"{key}_{'on' if on else 'off'}"] = statistics.median(times[on])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=30, help="collections timed per setting and model (30)")
    p.add_argument("--holdout", type=int, default=256, help="holdout examples (256)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)   # one thread: the comparison is not at the mercy of the other core's load
    print(f"track_activations on vs off, {args.repeats} collections each (median), holdout {args.holdout} "
          f"examples, collect_every_n {EVERY}, torch {torch.__version__}, 1 thread")
    with tempfile.TemporaryDirectory() as root:
        for name, model in models().items():
            r = measure(name, model, args.holdout, args.repeats, root)
            print(f"{name}: collection {r['collect_on'] * 1e3:.1f} ms on vs {r['collect_off'] * 1e3:.1f} ms off "
                  f"= {r['collect_on'] / r['collect_off']:.3f}x; a step that does not collect: on_batch_end "
                  f"{r['skip_on'] * 1e6:.2f} vs {r['skip_off'] * 1e6:.2f} us = {r['skip_on'] / r['skip_off']:.2f}x, "
                  f"the training step {r['train_on'] / r['train_off']:.3f}x; forward hooks on the model while "
                  f"training: {r['hooks_in_training']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
