"""Where one collection's time goes on the CNN, against what the memory system allows, in one process.

    python bench/collection_parts.py [--rounds 200] [--json out.json]

The CNN of compare.py (3C3D, batch 64, SGD) trains on the process's threads with the default config
collecting at every step (no holdout). Each round trains one step and collects, timing the hook and, inside
it, the weight pass (streamed_weight_changes: ||w||, ||w - r||, ||w - W0|| from the weights, the reference
and W0), the reference write (write_tensor_file) and the gradient norms (_Gradients.rows). On this model
they run one after the other, so what is left of the hook is the rest of the collection: the sections'
bookkeeping, the record and its line in the file.

Then the round trains another step and times the floor from the same state of the caches: one read of the
weights, the gradients and both files (torch.sum of each tensor, on the process's threads) and one write of
the weights' bytes into a file whose pages the page cache already holds (os.pwrite), as the reference is
rewritten in place. Prints the medians over rounds.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)
import telemetry as T  # noqa: E402
from compare import build_cnn, patched, timing_wrapper  # noqa: E402  (the benchmark's own workload)

PARTS = {"weight pass": (T, "streamed_weight_changes"), "reference write": (T, "write_tensor_file"),
         "gradient norms": (T._Gradients, "rows")}


def floor_s(directory, names, params, scratch):
    """(seconds to read the weights, gradients, reference and W0 once; seconds to write the weights' bytes over
    `scratch`, a file descriptor whose pages the page cache holds)."""
    refs, _ = T.map_tensor_file(os.path.join(directory, T.REFERENCE_FILE), names)
    inits, _ = T.map_tensor_file(os.path.join(directory, T.INITIAL_FILE), names)
    tensors = [p.detach() for p in params] + [p.grad for p in params] + refs + inits
    start = time.perf_counter()
    for t in tensors:
        t.sum()
    read = time.perf_counter() - start
    start = time.perf_counter()
    offset = 0
    for p in params:
        view = memoryview(p.detach().numpy()).cast("B")
        os.pwrite(scratch, view, offset)
        offset += len(view)
    return read, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--json", help="also write the medians here")
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    wl = build_cnn()
    model = wl.model
    opt = wl.opt = wl.opt_factory(model.parameters())
    params = [p for p in model.parameters() if p.requires_grad]
    k = [0]

    def step():
        k[0] += 1
        return wl.train_step(k[0] - 1)

    rows = {name: [] for name in ("hook", *PARTS, "rest", "floor read", "floor write", "floor")}
    with tempfile.TemporaryDirectory() as tmp:
        run = T.TrainingTelemetry(T.TelemetryConfig(output_dir=tmp, collect_every_n=1, track_holdout_logits=False))
        spent = dict.fromkeys(PARTS, 0.0)

        def add(part):
            return lambda seconds: spent.__setitem__(part, spent[part] + seconds)
        timers = {target: timing_wrapper(getattr(*target), add(part)) for part, target in PARTS.items()}
        scratch = os.open(os.path.join(tmp, "floor.bin"), os.O_RDWR | os.O_CREAT)
        nbytes = sum(p.numel() * p.element_size() for p in params)
        os.pwrite(scratch, bytes(nbytes), 0)  # its pages are in the page cache from here on
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        try:
            with patched(timers):
                for r in range(args.warmup + args.rounds):
                    batch, loss = step()
                    spent.update(dict.fromkeys(PARTS, 0.0))
                    start = time.perf_counter()
                    run.on_batch_end(model, opt, k[0], 0, batch=batch, loss=loss)
                    hook = time.perf_counter() - start
                    parts = dict(spent)

                    step()
                    read, write = floor_s(tmp, names, params, scratch)
                    if r >= args.warmup:
                        for name, value in [("hook", hook), *parts.items(), ("rest", hook - sum(parts.values())),
                                            ("floor read", read), ("floor write", write), ("floor", read + write)]:
                            rows[name].append(value * 1e3)
        finally:
            os.close(scratch)
            run.close()
    medians = {name: statistics.median(values) for name, values in rows.items()}
    print(f"cnn: {sum(p.numel() for p in params) / 1e6:.2f}M trainable parameters ({nbytes / 2**20:.1f} MiB); "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rounds} rounds; median ms")
    print(f"  collection (the hook)  {medians['hook']:7.3f}")
    for name in (*PARTS, "rest"):
        print(f"    {name:<20} {medians[name]:7.3f}")
    print(f"  floor                  {medians['floor']:7.3f}  (read w, g, r, W0 once {medians['floor read']:.3f} "
          f"+ write w into the page cache {medians['floor write']:.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "rounds": args.rounds,
                       "median_ms": medians}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
