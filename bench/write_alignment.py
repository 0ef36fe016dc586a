"""How fast a large reference is rewritten in place, by where its data section starts in the file.

    python bench/write_alignment.py [--mib 192] [--repeats 7] [--dir DIR]

The reference file is rewritten at every collection (telemetry.write_tensor_file). A safetensors data section
may start right after the JSON header, at any multiple of 8; on some machines the kernel's copy into the page
cache is several times slower at some of those offsets. telemetry.py pads the header so the data starts at
a multiple of 4096. This rewrites one file in place with the data at a few offsets, alternating, and prints
the median time of each, then times write_tensor_file itself (rename and spare included).
"""

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import telemetry  # noqa: E402

OFFSETS = (80, 112, 144, 512, 4096)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where the file goes (default: a temporary directory)")
    args = parser.parse_args(argv)
    w = torch.randn(args.mib << 18)
    data = memoryview((ctypes.c_char * (w.numel() * 4)).from_address(w.data_ptr()))
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        times = {off: [] for off in OFFSETS}
        paths = {off: os.path.join(d, f"at{off}.bin") for off in OFFSETS}
        for off, path in paths.items():
            with open(path, "wb") as f:
                f.write(b" " * off)
                f.write(data)
        for _ in range(args.repeats):
            for off, path in paths.items():
                start = time.perf_counter()
                with open(path, "r+b") as f:
                    f.write(b" " * off)
                    f.write(data)
                times[off].append(time.perf_counter() - start)
        for path in paths.values():
            os.remove(path)
        ref = os.path.join(d, "last_checkpoint.safetensors")
        named = [("weight", w)]
        writes = []
        for k in range(args.repeats + 2):
            start = time.perf_counter()
            telemetry.write_tensor_file(ref, named, metadata={"step": str(k)})
            writes.append(time.perf_counter() - start)
        offset = telemetry.tensor_file_info(ref)[1]
    print(f"{args.mib} MiB rewritten in place, median of {args.repeats} (alternating):")
    for off in OFFSETS:
        print(f"  data at byte {off:5d}: {statistics.median(times[off]) * 1e3:7.1f} ms")
    print(f"write_tensor_file (data at byte {offset}), median of the last {args.repeats}: "
          f"{statistics.median(writes[2:]) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
