"""What one collection costs, against what it must cost: the memory-bandwidth floor and the RSS rise.

    python bench/collection_cost.py [--width 4096] [--layers 3] [--repeats 5] [--baseline REV]

A collection reads every gradient (norms), reads every trainable weight and the on-disk reference (delta),
writes the new reference, and (default update ratio/drift) reads W_0: 5 x the trainable bytes at least. The
floor is those bytes over a copy bandwidth measured in this same run (dst.copy_(src) moves 2 x its size). The
peak RSS during each collection (the kernel's VmHWM, reset just before it) is compared with the RSS just
before it, as a share of the model's size.
The holdout and batch stats are off: this measures the part that scales with the model.

With TELEMETRY_COMPILE=1 the weight pass goes through torch.compile'd fused kernels, which the first
collection compiles as it ends: the run's first collection does so, then collections alternate with the
kernels and with the eager ops (side by side, same process). Then the compile's cost once, in a fresh
process. With --baseline REV, the first collection of a fresh process is timed for this telemetry.py and
for the one in git revision REV, alternating child processes.
"""

import argparse
import dataclasses
import json
import os
import subprocess
import statistics
import sys
import tempfile
import threading
import time

import torch
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import telemetry  # noqa: E402
from ab_collection import load, telemetry_at  # noqa: E402
from telemetry import TelemetryConfig, TrainingTelemetry  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRss:
    """The peak RSS during the block, read from the kernel: VmHWM, reset to the current RSS on entry through
    /proc/self/clear_refs. Exact, and nothing runs beside the collection: a thread that polled RSS took CPU time
    from it on a machine with few cores, which made it look slower."""

    def __enter__(self):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = rss_bytes()
        return self

    def __exit__(self, *exc):
        with open("/proc/self/status") as f:
            hwm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        self.peak = max(hwm_kb * 1024, self.base)


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


def fused_parts(out, model, repeats):
    """Where a fused collection's time goes, each part timed alone on this run's own files, alternating, on
    the threads a collection gives it: {part: median seconds}, and the bandwidth they are up against.

    gradient norms: the collection's per_tensor_sq_norms over the gradients (on its one intra-op thread); pass: the
    fused weight pass over the reference and W_0, mapped afresh and handed back 2 MiB at a time as a collection
    does; pass, pages kept: the same, never handed back (the RSS a collection must not take); pass in memory:
    the same kernels over copies of the files in anonymous memory; write: the reference rewritten alone, in
    place through the page cache (write_tensor_file over the spare); read floor: the pass's three reads at the
    read bandwidth measured here (sum over a large tensor)."""
    named = list(model.named_parameters())
    names = [n for n, _ in named]
    reference, initial = os.path.join(out, telemetry.REFERENCE_FILE), os.path.join(out, telemetry.INITIAL_FILE)
    cpu = torch.device("cpu")

    def sums(release):
        refs, rel_r = telemetry.map_tensor_file(reference, names)
        inits, rel_i = telemetry.map_tensor_file(initial, names)
        keep = telemetry._keep_pages
        return telemetry._ChangePass([p.detach().reshape(-1) for _, p in named], [r.view(-1) for r in refs],
                                     rel_r if release else keep, [r.view(-1) for r in inits],
                                     rel_i if release else keep, False, [], [], torch.float64)

    copies = sums(False)
    copies.refs, copies.inits = [r.clone() for r in copies.refs], [r.clone() for r in copies.inits]
    scratch = os.path.join(out, "parts.safetensors")
    telemetry.write_tensor_file(scratch, named)
    telemetry.write_tensor_file(scratch, named)  # from here on its spare is rewritten in place

    def grads():
        with telemetry._one_cpu_thread():
            telemetry.per_tensor_sq_norms([p.grad for _, p in named])

    def passing(make):
        def run():
            with telemetry._one_cpu_thread():
                telemetry._chunked_pass(make(), cpu, True)
        return run

    parts = {"gradient norms": grads, "pass": passing(lambda: sums(True)),
             "pass, pages kept": passing(lambda: sums(False)),
             "pass in memory": passing(lambda: dataclasses.replace(copies, kernels=[])),
             "write": lambda: telemetry.write_tensor_file(scratch, named)}
    times = {name: [] for name in parts}
    for k in range(repeats + 1):
        for name in (list(parts) if k % 2 == 0 else list(parts)[::-1]):
            times[name].append(_timed(parts[name]))
    big = torch.ones(64 << 20)
    read = big.numel() * big.element_size() / min(_timed(big.sum) for _ in range(repeats))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    medians = {name: statistics.median(values[1:]) for name, values in times.items()}
    medians["read floor"] = 3 * model_bytes / read
    return medians, read


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def build(width, layers):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(32, width)

    def step():
        optimizer.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        optimizer.step()
    return model, optimizer, step


def config(out, module=telemetry):
    return module.TelemetryConfig(output_dir=out, collect_every_n=1, track_holdout_logits=False,
                                  track_batch_stats=False, strict=True)


def timed_collections(telemetry_run, model, optimizer, step, repeats):
    """{"fused": [...], "eager": [...]} seconds per collection, alternating, with peak RSS rises."""
    # The eager collections get kernels that hold none and, with TELEMETRY_COMPILE=0, never ask for any: else
    # they would compile their own at the end of their first collection, and serve through them.
    eager = telemetry._FusedKernels()
    fused = telemetry._FUSED
    times, rises = {"fused": [], "eager": []}, {"fused": [], "eager": []}
    for k in range(2 * repeats):
        mode = ("fused", "eager")[k % 2]
        telemetry._FUSED = fused if mode == "fused" else eager
        os.environ["TELEMETRY_COMPILE"] = "1" if mode == "fused" else "0"
        step()
        with PeakRss() as rss:
            start = time.perf_counter()
            telemetry_run.on_batch_end(model, optimizer, 0, 0)
            times[mode].append(time.perf_counter() - start)
        rises[mode].append(rss.peak - rss.base)
        telemetry._FUSED = fused
        os.environ.pop("TELEMETRY_COMPILE")
    assert not eager.kernels and not eager.compiling, "the eager collections compiled kernels of their own"
    return times, rises


def first_collection_child(path, width, layers):
    """One fresh process's first collection with the telemetry.py at `path` (JSON on stdout)."""
    module = load("telemetry_under_test", path)
    torch.set_num_threads(os.cpu_count() or 1)
    model, optimizer, step = build(width, layers)
    with tempfile.TemporaryDirectory() as out:
        run = module.TrainingTelemetry(config(out, module))
        step()
        start = time.perf_counter()
        run.on_batch_end(model, optimizer, 0, 0)
        print(json.dumps({"first_s": time.perf_counter() - start}))


def child_json(args, *flags, env=None):
    """What a fresh process of this script run with `flags` (on the same model) prints last, as JSON."""
    out = subprocess.run([sys.executable, __file__, *flags, "--width", str(args.width), "--layers", str(args.layers)],
                         check=True, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONWARNINGS="ignore", **(env or {})))
    return json.loads(out.stdout.strip().splitlines()[-1])


def first_collections(args):
    """Median first-collection seconds {"this": ..., REV: ...} over alternating fresh child processes."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"this": os.path.join(REPO, "telemetry.py"), args.baseline: telemetry_at(args.baseline, tmp)}
        got = {name: [] for name in paths}
        for k in range(args.first_rounds):
            for name in (list(paths) if k % 2 == 0 else list(paths)[::-1]):
                got[name].append(child_json(args, "--first-child", paths[name])["first_s"])
    return {name: statistics.median(values) for name, values in got.items()}


def compile_cost_child(width, layers):
    """A fresh process's first collection (JSON on stdout): its seconds, which with TELEMETRY_COMPILE=1 include
    the compile of the fused kernels at its end, and the resident memory it added."""
    torch.set_num_threads(os.cpu_count() or 1)
    model, optimizer, step = build(width, layers)
    with tempfile.TemporaryDirectory() as out:
        run = TrainingTelemetry(TelemetryConfig(output_dir=out, collect_every_n=10**9, track_holdout_logits=False,
                                                track_batch_stats=False, strict=True))
        for _ in range(2):  # the optimizer's and autograd's first allocations
            step()
        rss, begin = rss_bytes(), time.perf_counter()
        run.on_batch_end(model, optimizer, 0, 0)
        print(json.dumps({"first_s": time.perf_counter() - begin, "rss_added": rss_bytes() - rss,
                          "kernels": sum(callable(k) for k in telemetry._FUSED.kernels.values()),
                          "failure": telemetry._FUSED.failure()}))


def compile_cost(args):
    """The compile's cost, against a process that does not compile: (with, without) results."""
    def child(env):
        return child_json(args, "--compile-child", "1", env=env)
    with tempfile.TemporaryDirectory() as cache:  # empty: what a machine's first run compiles
        fused = child({"TELEMETRY_COMPILE": "1", "TORCHINDUCTOR_CACHE_DIR": cache})
    return fused, child({"TELEMETRY_COMPILE": "0"})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", help="git revision whose first collection is timed against this one")
    parser.add_argument("--first-rounds", type=int, default=3)
    parser.add_argument("--no-compile-cost", action="store_true", help="skip the fused kernels' compile cost")
    parser.add_argument("--first-child", help=argparse.SUPPRESS)
    parser.add_argument("--compile-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.first_child:
        first_collection_child(args.first_child, args.width, args.layers)
        return 0
    if args.compile_child is not None:
        compile_cost_child(args.width, args.layers)
        return 0
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"load average at the start: {open('/proc/loadavg').read().split()[0]}")
    model, optimizer, step = build(args.width, args.layers)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with tempfile.TemporaryDirectory() as out:
        run = TrainingTelemetry(config(out))
        step()
        os.environ["TELEMETRY_COMPILE"] = "1"
        begin = time.perf_counter()
        run.on_batch_end(model, optimizer, 0, 0)  # writes the first reference, then compiles the kernels
        compile_s = time.perf_counter() - begin
        os.environ.pop("TELEMETRY_COMPILE")
        step()
        run.on_batch_end(model, optimizer, 0, 0)  # untimed: the second collection creates the reference's spare file
        bandwidth = copy_bandwidth(256 << 20)
        passes = 5 if run.config.track_update_ratio else 4
        floor = passes * model_bytes / bandwidth
        times, rises = timed_collections(run, model, optimizer, step, args.repeats)
        threads = max(1, min(len(os.sched_getaffinity(0)), 4))  # as telemetry._pass_threads for this model
        torch.set_num_threads(1)
        ops = op_floor(list(model.parameters()), [p.grad for p in model.parameters()], threads, args.repeats)
        torch.set_num_threads(os.cpu_count() or 1)
        per_call_us = skipped_call_us(out, model, optimizer)
        parts, read = fused_parts(out, model, args.repeats)
    report(args, model_bytes, bandwidth, passes, floor, compile_s, times, rises, ops, threads, per_call_us)
    print(f"where a fused collection's time goes (each part alone, median of {args.repeats}, alternating; read "
          f"bandwidth measured here {read / 2**30:.2f} GiB/s):")
    for name, seconds in parts.items():
        print(f"  {name:<17} {seconds * 1e3:6.1f} ms")
    if not args.no_compile_cost:
        fused, plain = compile_cost(args)
        print(f"the fused kernels' compile in a fresh process with an empty inductor cache (a machine's first "
              f"run): the first collection took {fused['first_s']:.1f} s with TELEMETRY_COMPILE=1 "
              f"({fused['kernels']} kernel(s) compiled at its end; failure: {fused['failure']}), against "
              f"{plain['first_s']:.2f} s with TELEMETRY_COMPILE=0; resident memory it added: "
              f"{fused['rss_added'] / 2**20:.0f} MiB (with TELEMETRY_COMPILE=0: {plain['rss_added'] / 2**20:.0f} MiB)")
    if args.baseline:
        first = first_collections(args)
        print(f"first collection of a fresh process (median of {args.first_rounds}, alternating child processes): "
              f"this {first['this'] * 1e3:.0f} ms, {args.baseline} {first[args.baseline] * 1e3:.0f} ms; "
              f"RATIO this / {args.baseline}: {first['this'] / first[args.baseline]:.2f}x   (target <= 1.10x)")
    print(f"load average at the end: {open('/proc/loadavg').read().split()[0]}")
    return 0


def skipped_call_us(out, model, optimizer, calls=200_000):
    skip = TrainingTelemetry(TelemetryConfig(output_dir=os.path.join(out, "skip"), collect_every_n=10**9))
    start = time.perf_counter()
    for i in range(1, calls + 1):
        skip.on_batch_end(model, optimizer, i, 0)
    return (time.perf_counter() - start) / calls * 1e6


def report(args, model_bytes, bandwidth, passes, floor, compile_s, times, rises, ops, threads, per_call_us):
    params = model_bytes / 4
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) = {params / 1e6:.1f}M parameters, "
          f"{model_bytes / 2**20:.0f} MiB; torch {torch.__version__}")
    print(f"fused kernels: the first collection, which compiled them, took {compile_s:.1f} s"
          f" {sorted(str(k) for k in telemetry._FUSED.kernels)}; failure: {telemetry._FUSED.failure()}")
    print(f"copy bandwidth (measured here): {bandwidth / 2**30:.2f} GiB/s; "
          f"bandwidth floor ({passes} x model bytes / copy bandwidth): {floor * 1e3:.0f} ms")
    for mode in ("fused", "eager"):
        median = statistics.median(times[mode])
        print(f"collection, {mode}: median {median * 1e3:.0f} ms over {args.repeats} (min {min(times[mode]) * 1e3:.0f},"
              f" max {max(times[mode]) * 1e3:.0f}); RATIO collection / floor: {median / floor:.2f}x"
              f"{'   (target <= 1.3x)' if mode == 'fused' else ''}; collection / op floor {median / ops:.2f}x; "
              f"peak RSS rise {max(rises[mode]) / model_bytes:.1%} of the model")
    fused, eager = statistics.median(times["fused"]), statistics.median(times["eager"])
    print(f"RATIO fused / eager (alternated in one process): {fused / eager:.2f}x")
    print(f"  op floor (the same unfused torch ops on in-memory tensors, {threads} threads, no files): "
          f"{ops * 1e3:.0f} ms = {ops / floor:.2f}x the bandwidth floor")
    print(f"RATIO peak RSS rise during a collection / model size: "
          f"{max(rises['fused'] + rises['eager']) / model_bytes:.1%}   (target < 10%)")
    print(f"non-collecting call: {per_call_us:.2f} us   (target < 5 us)")


if __name__ == "__main__":
    sys.exit(main())
