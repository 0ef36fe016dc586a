"""What one collection costs, against what it must cost: the memory-bandwidth floor and the RSS rise.

    python bench/collection_cost.py [--width 4096] [--layers 3] [--repeats 5]

A collection reads every gradient (norms), reads every trainable weight and the on-disk reference (delta),
writes the new reference, and (default update ratio/drift) reads W_0: 5 x the trainable bytes at least. The floor is those bytes over a copy
bandwidth measured in this same run (dst.copy_(src) moves 2 x its size). Peak RSS is sampled by a thread
during each collection and compared with the RSS just before it, as a share of the model's size.
The holdout and batch stats are off: this measures the part that scales with the model.
"""

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from telemetry import TelemetryConfig, TrainingTelemetry  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRss:
    """Samples RSS every 0.2 ms in a thread; torch ops and file I/O release the GIL, so it gets to run."""

    def __enter__(self):
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.0002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def copy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes per second moved by a large tensor copy (read + write), the best of a few tries."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * nbytes / best


def op_floor(weights, grads, threads: int, repeats: int) -> float:
    """The least time the torch ops of a collection take on this machine, with no files and no bookkeeping:
    the same ops on tensors already in memory, on the same number of threads. Gradient norms (_foreach_norm),
    then per 2 MiB chunk ||w||^2, ||w - r||^2 and ||w - w0||^2, each difference written out first (torch has
    no fused distance reduction: torch.dist and mse_loss materialise it too), while one thread copies the
    weights, standing in for the reference write. The gap between this and the bandwidth floor is the cost
    of those unfused ops; the gap between a collection and this is telemetry's own."""
    flats = [w.detach().reshape(-1) for w in weights]
    refs = [w.clone() for w in flats]
    inits = [w.clone() for w in flats]
    copies = [torch.empty_like(w) for w in flats]
    per = (2 << 20) // 4
    chunks = [(i, s) for i, w in enumerate(flats) for s in range(0, w.numel(), per)]

    def in_threads(calls):
        workers = [threading.Thread(target=c) for c in calls[1:]]
        for w in workers:
            w.start()
        calls[0]()
        for w in workers:
            w.join()

    def stream(part):
        scratch = torch.empty(per)
        sums = torch.zeros(3, len(flats))
        for i, s in part:
            w = flats[i][s:s + per]
            d = scratch[:w.numel()]
            sums[0, i] += torch.dot(w, w)
            torch.sub(w, refs[i][s:s + per], out=d)
            sums[1, i] += torch.dot(d, d)
            torch.sub(w, inits[i][s:s + per], out=d)
            sums[2, i] += torch.dot(d, d)

    def write():
        for c, w in zip(copies, flats):
            c.copy_(w)

    def collection():
        in_threads([lambda k=k: torch._foreach_norm(grads[k::threads]) for k in range(threads)])
        in_threads([lambda k=k: stream(chunks[k * len(chunks) // threads:(k + 1) * len(chunks) // threads])
                    for k in range(threads)] + ([write] if threads > 1 else []))
        if threads == 1:
            write()

    collection()
    return statistics.median(_timed(collection) for _ in range(repeats))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    params = sum(p.numel() for p in model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(32, args.width)

    def step():
        optimizer.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        optimizer.step()

    with tempfile.TemporaryDirectory() as out:
        config = TelemetryConfig(output_dir=out, collect_every_n=1, track_holdout_logits=False,
                                 track_batch_stats=False, strict=True)
        telemetry = TrainingTelemetry(config)
        step()
        telemetry.on_batch_end(model, optimizer, 0, 0)  # writes the first reference
        bandwidth = copy_bandwidth(256 << 20)
        torch.set_num_threads(1)  # a collection runs on one intra-op thread (telemetry._one_cpu_thread)
        bandwidth_one = copy_bandwidth(256 << 20)
        torch.set_num_threads(os.cpu_count() or 1)
        # Gradients, weights, the reference (read, then rewritten), and W_0 when drift is on: each once.
        passes = 5 if config.track_update_ratio else 4
        floor = passes * model_bytes / bandwidth
        times, rises = [], []
        for _ in range(args.repeats):
            step()
            with PeakRss() as rss:
                start = time.perf_counter()
                telemetry.on_batch_end(model, optimizer, 0, 0)
                times.append(time.perf_counter() - start)
            rises.append(rss.peak - rss.base)
        step_times = [_timed(step) for _ in range(args.repeats)]
        threads = max(1, min(len(os.sched_getaffinity(0)), 4))  # as telemetry._pass_threads for this model
        torch.set_num_threads(1)
        ops = op_floor(list(model.parameters()), [p.grad for p in model.parameters()], threads, args.repeats)
        torch.set_num_threads(os.cpu_count() or 1)

        calls = 200_000
        skip = TrainingTelemetry(TelemetryConfig(output_dir=out, collect_every_n=10**9))
        start = time.perf_counter()
        for i in range(1, calls + 1):
            skip.on_batch_end(model, optimizer, i, 0)
        per_call_us = (time.perf_counter() - start) / calls * 1e6

    collection = statistics.median(times)
    rise = max(rises)
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) = {params / 1e6:.1f}M parameters, "
          f"{model_bytes / 2**20:.0f} MiB; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"copy bandwidth (measured here): {bandwidth / 2**30:.2f} GiB/s")
    print(f"collection: median {collection * 1e3:.0f} ms over {args.repeats} "
          f"(min {min(times) * 1e3:.0f}, max {max(times) * 1e3:.0f}); training step {statistics.median(step_times) * 1e3:.0f} ms")
    print(f"bandwidth floor ({passes} x model bytes / copy bandwidth): {floor * 1e3:.0f} ms")
    print(f"RATIO collection / floor: {collection / floor:.2f}x   (target <= 2x)")
    print(f"  one-thread copy bandwidth {bandwidth_one / 2**30:.2f} GiB/s; "
          f"RATIO collection / one-thread floor: {collection / (passes * model_bytes / bandwidth_one):.2f}x")
    print(f"  op floor (the same unfused torch ops on in-memory tensors, {threads} threads, no files): "
          f"{ops * 1e3:.0f} ms = {ops / floor:.2f}x the bandwidth floor; RATIO collection / op floor: "
          f"{collection / ops:.2f}x")
    print(f"RATIO peak RSS rise during a collection / model size: {rise / model_bytes:.1%}   (target < 10%)")
    print(f"non-collecting call: {per_call_us:.2f} us   (target < 5 us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
