"""The fused weight-pass kernels (torch.compile): the same numbers as float64 sums of the same tensors and as
the eager ops, on the chunked and the whole-tensor paths; compiled off the collection's path; a failure is one
warning and the eager ops for good."""
import os
import time

import pytest
import torch
from torch import nn

import telemetry
from telemetry import TelemetryConfig, TrainingTelemetry

THRESHOLDS, REL = [1e-4, 1e-3, 1e-2], [1e-2, 1e-1]


@pytest.fixture(scope="module")
def kernels():
    """A process-wide kernel holder with both kernels compiled now, synchronously (the private seam)."""
    fused = telemetry._FusedKernels()
    for detail in (False, True):
        key = (str(torch.device("cpu")), torch.float32, detail, len(THRESHOLDS), len(REL)) if detail else \
            (str(torch.device("cpu")), torch.float32, False, 0, 0)
        fused.kernels[key] = telemetry._compile_change_kernel(*key)
    return fused


def tensors(seed=0):
    """Float32 tensors over several chunks (a tail too), and one too short for the kernel (eager)."""
    gen = torch.Generator().manual_seed(seed)
    per_chunk = telemetry.CHUNK_BYTES // 4
    sizes = [2 * per_chunk + 40_000, per_chunk, telemetry.FUSED_MIN_ELEMENTS + 3, 5_000]
    w = [torch.randn(n, generator=gen) for n in sizes]
    r = [t + 1e-3 * torch.randn(t.shape, generator=gen) for t in w]
    w0 = [t + 1e-1 * torch.randn(t.shape, generator=gen) for t in w]
    return w, r, w0


def files(tmp_path, w, r, w0):
    names = [f"t{i}" for i in range(len(w))]
    telemetry.write_tensor_file(str(tmp_path / "r"), list(zip(names, r)))
    telemetry.write_tensor_file(str(tmp_path / "w0"), list(zip(names, w0)))
    return list(zip(names, w)), str(tmp_path / "r"), str(tmp_path / "w0")


def float64_sums(w, r, w0):
    wide = [(a.double(), b.double(), c.double()) for a, b, c in zip(w, r, w0)]
    return {"weight_sq": [float(a @ a) for a, _, _ in wide], "delta_sq": [float((a - b) @ (a - b)) for a, b, _ in wide],
            "drift_sq": [float((a - c) @ (a - c)) for a, _, c in wide],
            "l1": [float((a - b).abs().sum()) for a, b, _ in wide], "sum": [float((a - b).sum()) for a, b, _ in wide],
            "max_abs": [float((a - b).abs().max()) if a.numel() else 0.0 for a, b, _ in wide]}


def changes(named, ref, init, fused, detail):
    with torch.no_grad():
        return telemetry.streamed_weight_changes(named, ref, init, THRESHOLDS if detail else [],
                                                 REL if detail else [], detail, fused=fused)


@pytest.mark.parametrize("detail", [False, True], ids=["norms", "param_change"])
def test_fused_pass_matches_float64_and_the_eager_ops(tmp_path, monkeypatch, kernels, detail):
    monkeypatch.setattr(telemetry, "_FUSED", kernels)
    monkeypatch.setattr(telemetry, "WHOLE_PASS_BYTES", 0)  # the chunked path, whatever the size
    w, r, w0 = tensors()
    named, ref, init = files(tmp_path, w, r, w0)
    fused = changes(named, ref, init, True, detail)
    eager = changes(named, ref, init, False, detail)
    want = float64_sums(w, r, w0)
    for key in ("weight_sq", "delta_sq", "drift_sq") + (("l1", "sum", "max_abs") if detail else ()):
        assert fused[key].tolist() == pytest.approx(want[key], rel=1e-6, abs=1e-6), key
        assert eager[key].tolist() == pytest.approx(want[key], rel=1e-4, abs=1e-4), key
    if detail:
        for key in ("flips", "below", "below_rel"):  # counts: exactly the eager ones
            assert torch.equal(fused[key], eager[key]), key
        d = [(a - b).abs() for a, b in zip(w, r)]
        assert fused["below"][1].tolist() == [int((x <= THRESHOLDS[1]).sum()) for x in d]


def test_fused_kernels_are_what_the_chunked_pass_calls(tmp_path, monkeypatch, kernels):
    """The fused numbers above come from the kernels: a pass that finds them ready calls them per long chunk."""
    monkeypatch.setattr(telemetry, "_FUSED", kernels)
    monkeypatch.setattr(telemetry, "WHOLE_PASS_BYTES", 0)
    key = (str(torch.device("cpu")), torch.float32, False, 0, 0)
    calls = []
    real = kernels.kernels[key]
    monkeypatch.setitem(kernels.kernels, key, lambda *args: calls.append(args[0].numel()) or real(*args))
    w, r, w0 = tensors()
    named, ref, init = files(tmp_path, w, r, w0)
    changes(named, ref, init, True, False)
    per_chunk = telemetry.CHUNK_BYTES // 4
    assert sorted(calls) == sorted([per_chunk, per_chunk, 40_000, per_chunk, telemetry.FUSED_MIN_ELEMENTS + 3])


def test_whole_tensor_pass_matches_float64_and_the_chunked_counts(tmp_path, monkeypatch):
    """Models up to WHOLE_PASS_BYTES: list-wide eager ops over whole tensors, float32 accumulation as the
    eager chunked pass (errors of 1e-5 on a million elements); the counts are exactly the chunked ones. An
    empty tensor (an FSDP2 rank's empty shard) adds nothing and has no maximum."""
    w, r, w0 = (ts + [torch.zeros(0)] for ts in tensors(1))
    named, ref, init = files(tmp_path, w, r, w0)
    got = changes(named, ref, init, True, True)
    want = float64_sums(w, r, w0)
    for key in ("weight_sq", "delta_sq", "drift_sq", "l1", "sum", "max_abs"):
        assert got[key].tolist() == pytest.approx(want[key], rel=1e-4, abs=1e-4), key
    monkeypatch.setattr(telemetry, "WHOLE_PASS_BYTES", 0)
    chunked = changes(named, ref, init, False, True)
    for key in ("flips", "below", "below_rel"):
        assert torch.equal(got[key], chunked[key]), key


def test_many_small_tensors_of_a_few_shapes_are_stacked_and_match_float64(tmp_path):
    """A LoRA model's hundreds of small tensors of a few shapes are measured a stack per shape, beside the
    others list-wide: the same sums as float64 (bf16 ones and a 0-dim one among them), also for the
    gradient norms; and the stacks are what served (groups of 16 or more)."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(8, 64), (64, 8), (8, 64), (5,), (8, 128), (300, 7)] * 20 + [(), (3, 3, 3, 3), (0,)]
    w = [torch.randn(s, generator=gen) for s in shapes]
    w = [t.bfloat16() if k % 7 == 3 else t for k, t in enumerate(w)]
    r = [t + (1e-3 * torch.randn(t.shape, generator=gen)).to(t.dtype) for t in w]
    w0 = [t + (1e-1 * torch.randn(t.shape, generator=gen)).to(t.dtype) for t in w]
    groups, rest = telemetry._same_shape_groups([t.reshape(-1) for t in w])
    assert len(groups) >= 4 and rest  # the stacks serve most, the list-wide ops the rest
    named, ref, init = files(tmp_path, w, r, w0)
    got = changes(named, ref, init, False, False)
    want = float64_sums(*([t.reshape(-1) for t in ts] for ts in (w, r, w0)))
    for key in ("weight_sq", "delta_sq", "drift_sq"):
        assert got[key].dtype == torch.float32 and len(got[key]) == len(w)
        assert got[key].tolist() == pytest.approx(want[key], rel=1e-5, abs=1e-12), key
    norms = telemetry.per_tensor_sq_norms(w)
    assert norms.tolist() == pytest.approx([float(t.double().square().sum()) for t in w], rel=1e-5, abs=1e-12)


def test_a_model_of_many_scalar_parameters_is_measured(tmp_path):
    """20 learnable 0-dim scalars (a ReZero gate per block) and 20 empty tensors stack into groups of one
    dimension: the gradient norm and the weight delta against get_total_norm and weight copies."""
    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(20))
            self.gates = nn.ParameterList(nn.Parameter(torch.tensor(0.5)) for _ in range(20))
            self.empty = nn.ParameterList(nn.Parameter(torch.zeros(0)) for _ in range(20))

        def forward(self, x):
            for block, gate in zip(self.blocks, self.gates):
                x = x + gate * torch.tanh(block(x))
            return x

    torch.manual_seed(0)
    model = Gated()
    assert len(telemetry._same_shape_groups([p.detach() for p in model.parameters()])[0]) == 4
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, track_holdout_logits=False,
                                            strict=True))
    for step in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        model(torch.randn(8, 4)).square().mean().backward()
        want = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
        opt.step()
        rec = tel.on_batch_end(model, opt, step, 0)
        opt.zero_grad()
        assert rec["gradient_norm"]["overall"] == pytest.approx(want, rel=1e-5)
        if step:
            moved = sum(float((p.detach().double() - b.double()).square().sum())
                        for p, b in zip(model.parameters(), before)) ** 0.5
            assert rec["weight_delta"]["overall"] == pytest.approx(moved, rel=1e-5)
    tel.close()


class Wide(nn.Module):
    """17 MiB of float32: above WHOLE_PASS_BYTES, so the chunked pass and the kernels serve it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(1024, 2048), nn.Linear(2048, 1024)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def train(model, opt, tel, steps, start=0):
    records = []
    for step in range(start, start + steps):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        model(torch.randn(4, 1024)).square().mean().backward()
        opt.step()
        records.append((tel.on_batch_end(model, opt, step, 0), before,
                        {n: p.detach().clone() for n, p in model.named_parameters()}))
        opt.zero_grad()
    return records


def test_compile_at_the_first_collection_then_fused_collections_match_weight_copies(tmp_path, monkeypatch,
                                                                                     kernels):
    """With TELEMETRY_COMPILE=1 the first collection asks for the kernel and compiles it when it ends, on the
    loop's own thread (never beside a forward); the next collections use it, with the same numbers."""
    monkeypatch.setenv("TELEMETRY_COMPILE", "1")
    fused = telemetry._FusedKernels()
    monkeypatch.setattr(telemetry, "_FUSED", fused)
    compiled = []
    real = telemetry._compile_change_kernel

    def compile_here(*key):
        compiled.append(key)
        assert telemetry.threading.current_thread() is telemetry.threading.main_thread()
        return kernels.kernels.get(key) or real(*key)  # the module's kernels: no second compile here
    monkeypatch.setattr(telemetry, "_compile_change_kernel", compile_here)
    torch.manual_seed(0)
    model = Wide()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True))
    records = train(model, opt, tel, 1)
    assert compiled == [("cpu", torch.float32, False, 0, 0)] and callable(fused.kernels[compiled[0]])
    records += train(model, opt, tel, 3, start=1)
    for rec, before, after in records[1:]:
        delta = torch.cat([(after[n] - before[n]).double().reshape(-1) for n in after]).norm().item()
        norm = torch.cat([after[n].double().reshape(-1) for n in after]).norm().item()
        assert rec["weight_delta"]["overall"] == pytest.approx(delta, rel=1e-5)
        assert rec["weight_norm"]["overall"] == pytest.approx(norm, rel=1e-6)
    tel.close()


def test_a_failed_compile_warns_once_and_the_eager_ops_serve(tmp_path, monkeypatch):
    monkeypatch.setenv("TELEMETRY_COMPILE", "1")
    fused = telemetry._FusedKernels()
    monkeypatch.setattr(telemetry, "_FUSED", fused)

    def no_compiler(*key):
        raise RuntimeError("no C++ compiler found")
    monkeypatch.setattr(telemetry, "_compile_change_kernel", no_compiler)
    model = Wide()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1))
    with pytest.warns(RuntimeWarning, match="could not be compiled .*no C\\+\\+ compiler") as seen:
        train(model, opt, tel, 1)
        deadline = time.monotonic() + 30
        while fused.compiling and time.monotonic() < deadline:
            time.sleep(0.01)
        records = train(model, opt, tel, 3, start=1)
    assert sum("could not be compiled" in str(w.message) for w in seen) == 1
    assert all(rec["weight_delta"]["overall"] > 0 for rec, *_ in records)
    assert fused.wanted == [] and not fused.compiling  # never tried again
    tel.close()


def test_without_the_switch_and_for_small_models_nothing_compiles(tmp_path, monkeypatch):
    fused = telemetry._FusedKernels()
    monkeypatch.setattr(telemetry, "_FUSED", fused)
    for value in ("0", None):  # off, and off by default
        if value is None:
            monkeypatch.delenv("TELEMETRY_COMPILE")
        else:
            monkeypatch.setenv("TELEMETRY_COMPILE", value)
        model = Wide()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / f"off{value}"), collect_every_n=1,
                                                strict=True))
        train(model, opt, tel, 2)
        tel.close()
        assert fused.wanted == [] and fused.kernels == {} and not fused.compiling
    monkeypatch.setenv("TELEMETRY_COMPILE", "1")
    small = nn.Linear(64, 64)
    opt = torch.optim.SGD(small.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "small"), collect_every_n=1, strict=True))
    for step in range(2):
        small(torch.randn(2, 64)).sum().backward()
        opt.step()
        tel.on_batch_end(small, opt, step, 0)
    assert fused.wanted == [] and not fused.compiling


def test_a_forked_child_keeps_ready_kernels_and_drops_a_compile_in_flight():
    fused = telemetry._FusedKernels()
    ready, flying = ("cpu", torch.float32, False, 0, 0), ("cpu", torch.bfloat16, False, 0, 0)
    fused.kernels[ready] = telemetry._change_sums
    fused.wanted, fused.compiling = [flying], True
    fused.pid = os.getpid() + 1  # as a forked child sees its parent's holder
    assert fused.ready(ready) is telemetry._change_sums
    assert fused.ready(flying) is None and "forked" in fused.kernels[flying]
    assert not fused.compiling and fused.busy.acquire(blocking=False)


def test_kept_maps_show_rewrites_in_place_and_map_a_new_layout_afresh(tmp_path):
    """A small reference stays mapped between collections: the map shows what write_tensor_file rewrote in
    place (the spare's inode comes back as the reference every other write), and a file laid out otherwise
    is mapped anew."""
    maps = telemetry._KeptMaps(telemetry._WrittenHeaders())
    path = str(tmp_path / "ref")

    def write(value, names=("a", "b")):
        telemetry.write_tensor_file(path, [(n, torch.full((1000,), float(value))) for n in names])

    for value in (1, 2):
        write(value)
    inode = os.stat(path).st_ino
    first, _ = maps.map(path, ["a", "b"])
    for value in (3, 4):  # the reference alternates between two inodes: back to the mapped one
        write(value)
    assert os.stat(path).st_ino == inode
    again, release = maps.map(path, ["a", "b"])
    assert again is first and torch.equal(again[0], torch.full((1000,), 4.0))
    release(0, 0, 1000)  # a kept map keeps its pages
    assert torch.equal(again[1], torch.full((1000,), 4.0))
    for value in (5, 6):
        write(value, names=("a", "c"))
    other, _ = maps.map(path, ["a", "c"])
    assert other is not first and torch.equal(other[1], torch.full((1000,), 6.0))


def test_a_compile_leaves_the_random_numbers_as_they_were(monkeypatch):
    """A real compile (torch.compile puts the global RNG state back as it found it, and the compiler may draw
    numbers of its own): afterwards every draw is the seed's next one, as without the compile."""
    monkeypatch.setenv("TELEMETRY_COMPILE", "1")
    fused = telemetry._FusedKernels()
    key = ("cpu", torch.bfloat16, False, 0, 0)
    assert fused.ready(key) is None and fused.wanted == [key]
    torch.manual_seed(1234)
    fused.start()
    assert callable(fused.kernels[key]), fused.kernels[key]
    draws = torch.rand(20).tolist()
    assert draws == torch.rand(20, generator=torch.Generator().manual_seed(1234)).tolist()


@pytest.mark.parametrize("detail", [False, True], ids=["norms", "param_change"])
def test_device_block_pass_matches_float64_and_the_chunked_counts(tmp_path, monkeypatch, detail):
    """Weights on a GPU are passed block by block (here forced on the CPU, with blocks of 64 KiB): tensors cut
    across blocks, blocks cut where the dtype changes (bf16 and float32 tensors), an empty tensor; the sums
    as float64 ones of the same tensors, the counts exactly the chunked pass's."""
    gen = torch.Generator().manual_seed(5)
    w, r, w0 = tensors(2)
    extra = [torch.randn(70_001, generator=gen).bfloat16(), torch.randn(3, generator=gen).bfloat16(), torch.zeros(0)]
    w += extra
    r += [t + (1e-2 * torch.randn(t.shape, generator=gen)).to(t.dtype) for t in extra]
    w0 += [t + (1e-1 * torch.randn(t.shape, generator=gen)).to(t.dtype) for t in extra]
    named, ref, init = files(tmp_path, w, r, w0)
    monkeypatch.setattr(telemetry, "WHOLE_PASS_BYTES", 0)
    chunked = changes(named, ref, init, False, detail)
    monkeypatch.setattr(telemetry, "_blockwise", lambda flats: True)
    monkeypatch.setattr(telemetry, "DEVICE_BLOCK_BYTES", 64 << 10)
    blocks = telemetry._device_blocks([t.reshape(-1) for t in w])
    assert len(blocks) > 100 and any(len(b) > 1 for b in blocks)
    assert all(len({w[i].dtype for i, *_ in b}) == 1 for b in blocks)
    got = changes(named, ref, init, False, detail)
    want = float64_sums(w, r, w0)
    for key in ("weight_sq", "delta_sq", "drift_sq") + (("l1", "sum", "max_abs") if detail else ()):
        assert got[key].tolist() == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    for key in ("flips", "below", "below_rel") if detail else ():
        assert torch.equal(got[key], chunked[key]), key
    # a rank whose shards are all empty (FSDP2): every key, zero for each tensor
    empty = [torch.zeros(0), torch.zeros(0, 3)]
    named, ref, init = files(tmp_path, empty, empty, empty)
    got = changes(named, ref, init, False, detail)
    assert set(got) == set(chunked) and all(v.shape[-1] == 2 and not v.any() for v in got.values())
