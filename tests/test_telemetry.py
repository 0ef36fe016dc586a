"""Core telemetry: every number is checked against a reference computed another way."""

import collections
import copy
import json
import math
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
from torch import nn

import telemetry
from telemetry import TelemetryConfig, TrainingTelemetry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def strict_json(line):
    def reject(token):
        raise ValueError(f"non-strict JSON token {token}")
    return json.loads(line, parse_constant=reject)


def read_records(run_dir):
    with open(os.path.join(run_dir, "telemetry.jsonl")) as f:
        return [strict_json(line) for line in f]


class TwoPart(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.relu(self.backbone(x)))


def make_run(tmp_path, model=None, **config):
    torch.manual_seed(0)
    model = model or TwoPart()
    optimizer = torch.optim.SGD([
        {"params": model.backbone.parameters(), "lr": 0.01, "name": "backbone"},
        {"params": model.head.parameters(), "lr": 0.1, "name": "head"},
    ])
    cfg = TelemetryConfig(output_dir=str(tmp_path / "run"), collect_every_n=1, strict=True, **config)
    return model, optimizer, TrainingTelemetry(cfg)


def train_step(model, optimizer, x=None, y=None):
    x = torch.randn(12, 8) if x is None else x
    y = torch.randint(0, 3, (12,)) if y is None else y
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss, (x, y)


def train_collecting(tel, model, optimizer, steps):
    """Train and collect every step; returns every warning raised, repeats included."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            train_step(model, optimizer)
            tel.on_batch_end(model, optimizer, 0, 0)
    return caught


# ---- config ---------------------------------------------------------------------------------------


def test_unknown_key_names_the_key_and_suggests_the_closest():
    with pytest.raises(ValueError, match=r"collect_every_nn.*did you mean collect_every_n\?"):
        TelemetryConfig.from_dict({"collect_every_nn": 5})


@pytest.mark.parametrize("bad, field", [
    ({"collect_every_n": "10"}, "collect_every_n"),
    ({"collect_every_n": True}, "collect_every_n"),
    ({"enabled": "yes"}, "enabled"),
    ({"holdout_size": 2.5}, "holdout_size"),
    ({"groups": {"head": [3]}}, "groups"),
    ({"collect_every_n": 0}, "collect_every_n"),
])
def test_bad_values_fail_at_construction_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        TelemetryConfig.from_dict(bad)


def test_output_dir_that_cannot_be_written_fails_naming_the_field(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"^output_dir:"):
        TelemetryConfig(output_dir=str(blocker / "run"))


def test_from_yaml_reads_the_shipped_file_and_kwargs_override(tmp_path):
    cfg = TelemetryConfig.from_yaml(os.path.join(ROOT, "telemetry.yaml"), output_dir=str(tmp_path),
                                    collect_every_n=7)
    assert cfg.collect_every_n == 7 and cfg.output_dir == str(tmp_path)
    assert cfg.batch_label_key is None and cfg.alert_window == 50  # from the file: no dataset-specific label key
    flat = tmp_path / "flat.yaml"
    flat.write_text("collect_every_n: 3\ncollect_every_nn: 4\n")
    with pytest.raises(ValueError, match="did you mean collect_every_n"):
        TelemetryConfig.from_yaml(str(flat))


def test_every_config_field_is_documented_in_the_yaml():
    import yaml
    with open(os.path.join(ROOT, "telemetry.yaml")) as f:
        text = f.read()
    documented = yaml.safe_load(text)["telemetry"]
    fields = {f.name for f in telemetry.dataclasses.fields(TelemetryConfig)}
    assert fields <= set(documented), fields - set(documented)
    for name in fields:  # one-line comment on each
        line = next(l for l in text.splitlines() if l.strip().startswith(name + ":"))
        assert "#" in line, line


# ---- gradient norms -------------------------------------------------------------------------------


def test_gradient_norms_match_get_total_norm_and_groups_add_up(tmp_path, pass_threads):
    model, optimizer, tel = make_run(tmp_path)
    loss, _ = train_step(model, optimizer)
    rec = tel.on_batch_end(model, optimizer, 0, 0, loss=loss)
    grads = [p.grad for p in model.parameters()]
    expect = torch.nn.utils.get_total_norm(grads, 2.0).item()
    norms = rec["gradient_norm"]
    assert norms["overall"] == pytest.approx(expect, rel=1e-6)
    assert norms["backbone"] == pytest.approx(
        torch.nn.utils.get_total_norm([p.grad for p in model.backbone.parameters()]).item(), rel=1e-6)
    assert norms["head"] == pytest.approx(
        torch.nn.utils.get_total_norm([p.grad for p in model.head.parameters()]).item(), rel=1e-6)
    assert norms["backbone"] ** 2 + norms["head"] ** 2 == pytest.approx(norms["overall"] ** 2, rel=1e-6)


def test_config_groups_by_name_pattern(tmp_path):
    model, optimizer, tel = make_run(tmp_path, groups={"first": ["backbone.0"], "head": ["head.*"]})
    train_step(model, optimizer)
    rec = tel.on_batch_end(model, optimizer, 0, 0)
    norms = rec["gradient_norm"]
    assert norms["first"] == pytest.approx(
        torch.nn.utils.get_total_norm([p.grad for p in model.backbone[0].parameters()]).item(), rel=1e-6)
    assert norms["other"] == pytest.approx(
        torch.nn.utils.get_total_norm([p.grad for p in model.backbone[3].parameters()]).item(), rel=1e-6)
    assert norms["first"] ** 2 + norms["head"] ** 2 + norms["other"] ** 2 == pytest.approx(
        norms["overall"] ** 2, rel=1e-6)
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["groups"]["first"]["names"] == ["backbone.0.weight", "backbone.0.bias"]


def test_half_precision_gradients_are_normed_in_float32(tmp_path, pass_threads):
    model = nn.Linear(64, 64).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True))
    for p in model.parameters():
        p.grad = (torch.randn_like(p, dtype=torch.float32) * 300).to(torch.bfloat16)
    optimizer.step()  # lr 0: the gradients stay as set
    rec = tel.on_batch_end(model, optimizer, 0, 0)
    expect = torch.nn.utils.get_total_norm([p.grad.float() for p in model.parameters()]).item()
    assert rec["gradient_norm"]["overall"] == pytest.approx(expect, rel=1e-6)


def test_zeroed_gradients_record_null_and_warn_with_the_fix(tmp_path):
    model, optimizer, tel = make_run(tmp_path)
    train_step(model, optimizer)
    optimizer.zero_grad()  # set_to_none: the common wrong order
    with pytest.warns(RuntimeWarning, match="before zero_grad"):
        rec = tel.on_batch_end(model, optimizer, 0, 0)
    assert rec["gradient_norm"]["overall"] is None
    assert rec["gradient_norm"]["head"] is None
    line = read_records(tmp_path / "run")[-1]
    assert line["gradient_norm"]["overall"] is None and "nonfinite" not in line


def test_group_without_gradients_is_null_not_zero(tmp_path):
    model, optimizer, tel = make_run(tmp_path)
    train_step(model, optimizer)
    for p in model.head.parameters():
        p.grad = None
    rec = tel.on_batch_end(model, optimizer, 0, 0)
    assert rec["gradient_norm"]["head"] is None
    assert rec["gradient_norm"]["overall"] == pytest.approx(rec["gradient_norm"]["backbone"], rel=1e-6)


# ---- weight delta ---------------------------------------------------------------------------------


def test_weight_delta_matches_copies_kept_by_the_test(tmp_path):
    model, optimizer, tel = make_run(tmp_path)
    train_step(model, optimizer)
    first = tel.on_batch_end(model, optimizer, 0, 0)
    assert first["weight_delta"] == {"overall": None, "backbone": None, "head": None}
    kept = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(3):
        train_step(model, optimizer)
    rec = tel.on_batch_end(model, optimizer, 0, 0)

    def dist(prefix):
        return math.sqrt(sum((p.detach() - kept[n]).pow(2).sum().item()
                             for n, p in model.named_parameters() if n.startswith(prefix)))

    assert rec["weight_delta"]["overall"] == pytest.approx(dist(""), rel=1e-5)
    assert rec["weight_delta"]["backbone"] == pytest.approx(dist("backbone"), rel=1e-5)
    assert rec["weight_delta"]["head"] == pytest.approx(dist("head"), rel=1e-5)


def test_reference_holds_only_trainable_weights_and_loads_without_pickle(tmp_path):
    from safetensors.torch import load_file  # an independent reader of the file format

    model, optimizer, tel = make_run(tmp_path)
    for p in model.backbone.parameters():
        p.requires_grad_(False)
    train_step(model, optimizer)
    tel.on_batch_end(model, optimizer, 0, 0)
    path = tmp_path / "run" / "last_checkpoint.safetensors"
    loaded = load_file(str(path))
    assert set(loaded) == {"head.weight", "head.bias"}
    for name, p in model.head.named_parameters():
        assert torch.equal(loaded["head." + name], p.detach())
    assert b"pickle" not in path.read_bytes()[:200] and path.read_bytes()[8:9] == b"{"


def test_swapping_which_layer_is_frozen_is_seen_though_the_count_stays(tmp_path):
    """backbone.0 frozen as backbone.3 is unfrozen: as many trainable tensors as before, but other ones. The
    records measure the tensors trainable now, and run.json names them."""
    model, optimizer, tel = make_run(tmp_path)
    model.backbone[0].requires_grad_(False)
    for _ in range(2):
        train_step(model, optimizer)
        tel.on_batch_end(model, optimizer, 0, 0)
    model.backbone[0].requires_grad_(True)
    model.backbone[3].requires_grad_(False)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        train_step(model, optimizer)
        kept = {n: p.detach().clone() for n, p in model.named_parameters()}
        want = torch.nn.utils.get_total_norm([p.grad for p in model.backbone.parameters() if p.requires_grad])
        rec = tel.on_batch_end(model, optimizer, 0, 0)
        assert rec["gradient_norm"]["backbone"] == pytest.approx(want.item(), rel=1e-5)
    train_step(model, optimizer)
    rec = tel.on_batch_end(model, optimizer, 0, 0)
    moved = math.sqrt(sum((p.detach() - kept[n]).pow(2).sum().item() for n, p in model.named_parameters()
                          if n.startswith("backbone.0")))
    assert moved > 0 and rec["weight_delta"]["backbone"] == pytest.approx(moved, rel=1e-5)
    tel.close()
    groups = json.loads((tmp_path / "run" / "run.json").read_text())["groups"]["backbone"]
    assert groups["names"] == ["backbone.0.weight", "backbone.0.bias"]
    assert groups["frozen_names"] == ["backbone.3.weight", "backbone.3.bias"]


def test_the_trainable_set_is_read_as_model_parameters_gives_it():
    """The walk that checks the layout at every collection gives model.parameters()'s trainable tensors, in
    its order, on models that share a submodule, tie a weight, hold None, freeze some tensors and are
    changed in place (a layer replaced, a parameter added, one deleted); a class that walks its
    parameters its own way is read through parameters()."""
    def want(m):
        return tuple(id(p) for p in m.parameters() if p.requires_grad)

    shared = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), shared, torch.nn.ReLU(), torch.nn.Sequential(shared, None),
                                torch.nn.ModuleDict({"b": torch.nn.Linear(4, 2), "a": torch.nn.Linear(4, 2)}))
    model.register_parameter("none", None)
    model[4]["a"].weight = model[4]["b"].weight  # tied
    model[4]["b"].bias.requires_grad_(False)
    assert telemetry._trainable_ids(model) == want(model) and len(want(model)) == 6
    model[1] = torch.nn.Linear(4, 4)  # the shared layer replaced in one place only
    model[4]["a"].register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))
    del model[0].bias
    assert telemetry._trainable_ids(model) == want(model) and len(want(model)) == 8

    class OwnWalk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

        def named_modules(self, *args, **kwargs):  # skips b
            yield from ((n, m) for n, m in super().named_modules(*args, **kwargs) if m is not self.b)

    odd = torch.nn.Sequential(OwnWalk(), torch.nn.Linear(2, 2))
    assert telemetry._trainable_ids(odd) == want(odd) and len(want(odd)) == 4


def test_reference_data_starts_on_a_page_whatever_the_names(tmp_path):
    """The header is padded so the tensors start at a multiple of 4096 bytes: at some offsets (80 bytes,
    e.g.) rewriting a large reference was measured several times slower (bench/write_alignment.py)."""
    from safetensors.torch import load_file

    for k in range(1, 40, 7):  # names of several lengths give headers of several lengths
        path = str(tmp_path / f"ref{k}.safetensors")
        named = [("w" * k, torch.randn(5, 3)), ("b" * (2 * k), torch.arange(7, dtype=torch.int64))]
        telemetry.write_tensor_file(path, named, metadata={"step": str(k)})
        raw = open(path, "rb").read()
        data_offset = 8 + int.from_bytes(raw[:8], "little")
        assert data_offset % 4096 == 0 and raw[8:9] == b"{"
        loaded = load_file(path)
        assert all(torch.equal(loaded[n], t) for n, t in named)
        assert telemetry.tensor_file_info(path)[1] == data_offset


def test_reference_written_from_the_pass_chunks_equals_the_weights(tmp_path, monkeypatch):
    """Above WHOLE_PASS_BYTES the pass hands each chunk of the weights to the reference write as it sums it, on
    several threads: the file then holds every weight bit for bit (read back by safetensors), a channels_last
    convolution in its logical order and a bf16 tensor included, and the delta against weight copies holds."""
    from safetensors.torch import load_file

    monkeypatch.setattr(telemetry, "CHUNK_BYTES", 256)
    monkeypatch.setattr(telemetry, "WHOLE_PASS_BYTES", 0)
    monkeypatch.setattr(telemetry, "_pass_threads", lambda tensors: 3)
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 8, 3), nn.Linear(8 * 6 * 6, 4)
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.bfloat16))

        def forward(self, x):
            return self.fc(self.conv(x).flatten(1)) * self.scale.float()

    torch.manual_seed(0)
    model = Net()
    model.conv.to(memory_format=torch.channels_last)
    assert not model.conv.weight.is_contiguous()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "run"), collect_every_n=1,
                                            track_holdout_logits=False))
    x = torch.randn(16, 3, 8, 8)
    for k in range(3):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        rec = tel.on_batch_end(model, optimizer, k, 0)
        loaded = load_file(str(tmp_path / "run" / "last_checkpoint.safetensors"))
        assert set(loaded) == {n for n, _ in model.named_parameters()}
        for name, p in model.named_parameters():
            assert loaded[name].dtype == p.dtype and torch.equal(loaded[name], p.detach()), name
        if k:
            want = math.sqrt(sum(float((p.detach().double() - kept[n].double()).square().sum())
                                 for n, p in model.named_parameters()))
            assert rec["weight_delta"]["overall"] == pytest.approx(want, rel=1e-5)
        kept = {n: p.detach().clone() for n, p in model.named_parameters()}
    tel.close()


def test_runs_of_small_tensors_are_written_bit_for_bit(tmp_path, monkeypatch):
    """Small CPU tensors go to the file in blocks (one copy and one write per run of MIN_STACKED or more of one
    dtype, up to CHUNK_BYTES): hundreds of them, of three dtypes in runs long and short, a channels_last one
    in its logical order, an empty and a 0-dim one, and a run longer than a block, read back bit for bit by
    safetensors, also when the file is rewritten in place (its spare) with other values."""
    from safetensors.torch import load_file

    monkeypatch.setattr(telemetry, "CHUNK_BYTES", 1 << 16)
    g = torch.Generator().manual_seed(0)
    conv = torch.randn(4, 3, 2, 2, generator=g).to(memory_format=torch.channels_last)
    assert not conv.is_contiguous()
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.float16, torch.float32]
    runs = [40, 3, 60, 1, 25, 171]  # runs of one dtype: long ones go out in blocks, short ones tensor by tensor
    kinds = [dtype for dtype, n in zip(dtypes, runs) for _ in range(n)]
    named = [(f"t{i}", (torch.randn(1 + (i * 37) % 400, generator=g) * 100).to(kind)) for i, kind in enumerate(kinds)]
    named[5:5] = [("conv", conv), ("empty", torch.zeros(0)), ("scalar", torch.tensor(2.5)),
                  ("big", torch.randn(3000, generator=g)), ("ints", torch.arange(-20, 20))]
    path = str(tmp_path / "ref.safetensors")
    for round_ in range(3):
        telemetry.write_tensor_file(path, named, metadata={"step": str(round_)})
        loaded = load_file(path)
        assert set(loaded) == {n for n, _ in named}
        for n, t in named:
            assert loaded[n].dtype == t.dtype and loaded[n].shape == t.shape and torch.equal(loaded[n], t), n
        named = [(n, t + 1 if t.is_floating_point() else t - 1) for n, t in named]
    assert os.path.exists(path + ".spare")  # the last rounds rewrote the spare in place


def test_reference_write_fills_in_what_the_pass_did_not_hand_over(tmp_path):
    """write_tensor_file writes whatever `meanwhile` did not put: nothing, or part of a tensor."""
    from safetensors.torch import load_file

    named = [("a", torch.randn(300)), ("b", torch.arange(50, dtype=torch.int64)), ("c", torch.randn(7, 9))]
    for share in (0, 100, 300):
        path = str(tmp_path / f"ref{share}.safetensors")

        def meanwhile(put):
            put(0, 0, named[0][1][:share]) if share else None
            return "done"
        assert telemetry.write_tensor_file(path, named, meanwhile=meanwhile) == "done"
        loaded = load_file(path)
        assert all(torch.equal(loaded[n], t) for n, t in named)


def test_reference_write_is_atomic_when_interrupted(tmp_path):
    path = str(tmp_path / "ref.safetensors")
    good = [("a", torch.arange(4.0)), ("b", torch.ones(3))]
    telemetry.write_tensor_file(path, good)
    before = open(path, "rb").read()

    class Exploding:  # a stand-in tensor that dies mid-write, as a crash would
        dtype, shape = torch.float32, (2,)

        def numel(self):
            return 2

        def element_size(self):
            return 4

        def detach(self):
            raise KeyboardInterrupt("killed mid-write")

    with pytest.raises(KeyboardInterrupt):
        telemetry.write_tensor_file(path, [("a", torch.zeros(4)), ("b", Exploding())])
    assert open(path, "rb").read() == before
    assert not os.path.exists(path + ".tmp")


def test_bf16_delta_is_computed_in_float32(tmp_path):
    model = nn.Linear(256, 256).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True))
    optimizer.step()  # no gradients: the weights move only as set below
    tel.on_batch_end(model, optimizer, 0, 0)
    kept = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    optimizer.step()
    rec = tel.on_batch_end(model, optimizer, 0, 0)
    expect = math.sqrt(sum((p.detach().double() - k.double()).pow(2).sum().item()
                           for p, k in zip(model.parameters(), kept)))
    assert rec["weight_delta"]["overall"] == pytest.approx(expect, rel=1e-5)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_streaming_returns_the_tensors_written(tmp_path):
    path = str(tmp_path / "ref.safetensors")
    tensors = [("big", torch.randn(1000)), ("empty", torch.zeros(0)), ("half", torch.randn(7, 3).half()),
               ("mid", torch.randn(100, 3))]
    telemetry.write_tensor_file(path, tensors)
    got = list(telemetry.stream_tensor_file(path, [n for n, _ in tensors]))
    assert all(torch.equal(g, t) and g.dtype == t.dtype for (_, t), g in zip(tensors, got))
    chunks = list(telemetry.stream_tensor_chunks(path, ["mid", "big"]))
    assert torch.equal(torch.cat([c for i, _, c in chunks if i == 1]), tensors[0][1])


@pytest.mark.skipif(not os.path.exists("/proc/self/statm") or not telemetry._CAN_RELEASE_PAGES,
                    reason="needs Linux RSS accounting and madvise")
def test_streaming_keeps_rss_near_one_piece_not_the_file(tmp_path):
    """Reading a 64 MiB reference raises the process's RSS (as the OS counts it) by about one tensor for
    whole tensors, and about one chunk for chunks, never by the file's size."""
    path = str(tmp_path / "ref.safetensors")
    mib = 1 << 20
    telemetry.write_tensor_file(path, [(f"t{i}", torch.full((2 * mib,), float(i))) for i in range(8)])  # 8 x 8 MiB
    names = [f"t{i}" for i in range(8)]
    base, peak = _rss_bytes(), 0
    for i, t in enumerate(telemetry.stream_tensor_file(path, names)):
        assert t.sum().item() == 2 * mib * i  # every page read
        peak = max(peak, _rss_bytes() - base)
    assert peak < 20 * mib
    base, peak = _rss_bytes(), 0
    for _, _, chunk in telemetry.stream_tensor_chunks(path, names):
        chunk.sum()
        peak = max(peak, _rss_bytes() - base)
    assert peak < 3 * telemetry.CHUNK_BYTES
    # Many tensors smaller than a chunk: their releases are gathered, and still keep RSS near a chunk.
    small = [(f"s{i}", torch.full((mib // 16,), float(i))) for i in range(256)]  # 256 x 256 KiB
    telemetry.write_tensor_file(path, small)
    base, peak = _rss_bytes(), 0
    for _, _, chunk in telemetry.stream_tensor_chunks(path, [n for n, _ in small]):
        chunk.sum()
        peak = max(peak, _rss_bytes() - base)
    assert peak < 3 * telemetry.CHUNK_BYTES


def test_concurrently_returns_in_order_and_raises_after_all_stopped():
    finished = []

    def slow_ok():
        time.sleep(0.05)
        finished.append("slow")
        return 2

    def failing():
        raise KeyError("boom")

    assert telemetry._concurrently(lambda: 1, slow_ok, lambda: 3) == [1, 2, 3]
    finished.clear()
    with pytest.raises(KeyError):
        telemetry._concurrently(failing, slow_ok)
    assert finished == ["slow"]  # the other thread was waited for, not abandoned


def test_streaming_works_where_files_cannot_be_mapped(tmp_path, monkeypatch):
    path = str(tmp_path / "ref.safetensors")
    tensors = [("a", torch.randn(300)), ("b", torch.randn(4, 5).double())]
    telemetry.write_tensor_file(path, tensors)

    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")  # what mmap raises on a filesystem without it

    monkeypatch.setattr(telemetry.mmap, "mmap", refuse)
    got = list(telemetry.stream_tensor_file(path, ["a", "b"]))
    assert all(torch.equal(g, t) for (_, t), g in zip(tensors, got))
    chunks = [c for _, _, c in telemetry.stream_tensor_chunks(path, ["a"])]
    assert torch.equal(torch.cat(chunks), tensors[0][1])


def test_truncated_reference_is_refused_not_mapped(tmp_path):
    path = str(tmp_path / "ref.safetensors")
    telemetry.write_tensor_file(path, [("a", torch.randn(4096))])
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(ValueError, match="truncated"):
        telemetry.map_tensor_file(path, ["a"])


def test_resume_appends_and_uses_the_reference_on_disk(tmp_path, pass_threads):
    model, optimizer, tel = make_run(tmp_path)
    for _ in range(2):
        train_step(model, optimizer)
        tel.on_batch_end(model, optimizer, 0, 0)
    tel.close()
    kept = {n: p.detach().clone() for n, p in model.named_parameters()}
    again = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "run"), collect_every_n=1,
                                              strict=True))
    train_step(model, optimizer)
    rec = again.on_batch_end(model, optimizer, 0, 1)
    expect = math.sqrt(sum((p.detach() - kept[n]).pow(2).sum().item() for n, p in model.named_parameters()))
    assert rec["weight_delta"]["overall"] == pytest.approx(expect, rel=1e-5)
    records = read_records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert len(info["starts"]) == 2


def test_a_resume_counts_the_steps_taken_after_the_last_record(tmp_path):
    """25 steps collected every 10 batches: the last record is step 21, and close() keeps the 25. The next
    start's steps are 26 and on, and its first delta is measured from the reference of step 21."""
    model, optimizer, _ = make_run(tmp_path / "unused")
    run = str(tmp_path / "run")
    for start in range(2):
        tel = TrainingTelemetry(TelemetryConfig(output_dir=run, collect_every_n=10, strict=True))
        for batch_idx in range(25):
            train_step(model, optimizer)
            tel.on_batch_end(model, optimizer, batch_idx, start)
        tel.close()
    records = read_records(run)
    assert [r["step"] for r in records] == [1, 11, 21, 26, 36, 46]
    assert records[3]["reference_step"] == 21
    assert json.loads(open(os.path.join(run, "run.json")).read())["steps"] == 50


def test_two_instances_never_mix(tmp_path):
    m1, o1, t1 = make_run(tmp_path / "one")
    m2 = nn.Linear(4, 2)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    t2 = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "two"), collect_every_n=1, strict=True))
    for _ in range(2):
        train_step(m1, o1)
        t1.on_batch_end(m1, o1, 0, 0)
        o2.zero_grad()
        m2(torch.randn(3, 4)).sum().backward()
        o2.step()
        t2.on_batch_end(m2, o2, 0, 0)
    r1, r2 = read_records(tmp_path / "one" / "run"), read_records(tmp_path / "two")
    assert len(r1) == len(r2) == 2
    assert set(r1[0]["gradient_norm"]) == {"overall", "backbone", "head"}
    assert set(r2[0]["gradient_norm"]) == {"overall", "group_0"}
    from safetensors.torch import load_file
    assert set(load_file(str(tmp_path / "two" / "last_checkpoint.safetensors"))) == {"weight", "bias"}


# ---- learning rates -------------------------------------------------------------------------------


def test_learning_rates_are_the_current_ones_after_the_scheduler(tmp_path):
    model, optimizer, tel = make_run(tmp_path)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: 0.5 ** s, lambda s: 1.0 / (1 + s)])
    for step in range(4):
        train_step(model, optimizer)
        scheduler.step()
        rec = tel.on_batch_end(model, optimizer, step, 0)
        expected = scheduler.get_last_lr()
        assert rec["learning_rates"]["backbone"] == pytest.approx(expected[0])
        assert rec["learning_rates"]["head"] == pytest.approx(expected[1])
        assert rec["learning_rates"]["overall"] == pytest.approx(max(expected))


def test_unnamed_groups_are_group_i_and_unoptimized_params_are_reported_not_summed(tmp_path):
    model = TwoPart()
    optimizer = torch.optim.SGD([{"params": model.head.parameters(), "lr": 0.3}], lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            train_step(model, optimizer)
            rec = tel.on_batch_end(model, optimizer, 0, 0)
    assert rec["learning_rates"] == {"overall": 0.3, "group_0": 0.3}
    # The backbone's gradients (nothing zeroes them: train_step zeroes only the optimizer's) stay out of the
    # overall norm, which is the head's alone.
    assert set(rec["gradient_norm"]) == {"overall", "group_0"}
    assert rec["gradient_norm"]["overall"] == pytest.approx(
        torch.nn.utils.get_total_norm([p.grad for p in model.head.parameters()]).item(), rel=1e-6)
    outside = json.loads((tmp_path / "run.json").read_text())["not_in_optimizer"]
    assert outside["names"] == [n for n, _ in model.backbone.named_parameters(prefix="backbone")]
    assert outside["elements"] == sum(p.numel() for p in model.backbone.parameters())
    assert len([w for w in caught if "in no optimizer group" in str(w.message)]) == 1


# ---- holdout --------------------------------------------------------------------------------------


def test_holdout_counts_examples_and_matches_a_manual_evaluation(tmp_path):
    model, optimizer, tel = make_run(tmp_path, holdout_size=20)
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen)) for _ in range(5)]
    tel.set_holdout_data(batches)
    train_step(model, optimizer)
    rec = tel.on_batch_end(model, optimizer, 0, 0)["holdout_logits"]
    x = torch.cat([b[0] for b in batches])[:20]
    y = torch.cat([b[1] for b in batches])[:20]
    model.eval()
    with torch.no_grad():
        logits = model(x)
    assert len(rec["labels"]) == 20 and rec["labels"] == y.tolist()
    assert rec["predictions"] == logits.argmax(-1).tolist()
    assert rec["accuracy"] == pytest.approx((logits.argmax(-1) == y).float().mean().item())
    assert rec["loss"] == pytest.approx(nn.functional.cross_entropy(logits, y).item(), rel=1e-5)
    assert torch.allclose(torch.tensor(rec["logits"]), logits, atol=1e-6)


def test_holdout_with_custom_forward_for_siamese_batches(tmp_path):
    sys.path.insert(0, ROOT)
    from example_train import SiameseWinner

    model = SiameseWinner()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True,
                                            holdout_size=6))
    batch = {"img1": torch.randn(6, 256), "img2": torch.randn(6, 256), "winner": torch.tensor([0, 1] * 3)}
    tel.set_holdout_data([batch], forward=lambda m, b: m(b["img1"], b["img2"]), labels=lambda b: b["winner"])
    optimizer.step()
    rec = tel.on_batch_end(model, optimizer, 0, 0)["holdout_logits"]
    model.eval()
    with torch.no_grad():
        expect = model(batch["img1"], batch["img2"]).argmax(-1).tolist()
    assert rec["predictions"] == expect and rec["labels"] == [0, 1] * 3
    # the default dict path (model(**batch without the label)) gives the same answer
    tel2 = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "b"), collect_every_n=1, strict=True))
    tel2.set_holdout_data(batch)
    optimizer.step()
    assert tel2.on_batch_end(model, optimizer, 0, 0)["holdout_logits"]["predictions"] == expect


def test_holdout_restores_modes_and_rng(tmp_path):
    model, optimizer, tel = make_run(tmp_path, model=TwoPart(dropout=0.5))
    tel.set_holdout_data([(torch.randn(4, 8), torch.tensor([0, 1, 2, 0]))])
    model.train()
    model.backbone[0].eval()  # a user's deliberate per-module mode must survive
    before = {name: m.training for name, m in model.named_modules()}
    rng = torch.get_rng_state()
    tel.on_batch_end(model, optimizer, 0, 0)
    assert {name: m.training for name, m in model.named_modules()} == before
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_holdout_is_scored_where_the_program_blocked_numpy(tmp_path, monkeypatch):
    # sys.modules["numpy"] = None is how a program keeps numpy from importing: there is no NumPy state to keep.
    model, optimizer, tel = make_run(tmp_path)
    monkeypatch.setitem(sys.modules, "numpy", None)
    tel.set_holdout_data([(torch.randn(4, 8), torch.tensor([0, 1, 2, 0]))])
    loss, batch = train_step(model, optimizer)
    assert tel.on_batch_end(model, optimizer, 1, 0, batch=batch)["holdout_logits"]["accuracy"] is not None


def _seeded_run(out_dir, telemetry_on):
    sys.path.insert(0, ROOT)
    import example_train
    return example_train.train("healthy", out=out_dir, collect_every_n=1, telemetry_on=telemetry_on,
                               epochs=1, quiet=True, seed=7)


def test_non_invasive_bit_identical_weights_with_dropout(tmp_path):
    with_tel = _seeded_run(str(tmp_path / "on"), True)
    without = _seeded_run(str(tmp_path / "off"), False)
    assert any(isinstance(m, nn.Dropout) and m.p > 0 for m in with_tel.modules())
    records = read_records(tmp_path / "on")
    assert len(records) == 128 and all("holdout_logits" in r for r in records)
    for (n, a), (_, b) in zip(with_tel.state_dict().items(), without.state_dict().items()):
        assert torch.equal(a, b), n


# ---- batch stats ----------------------------------------------------------------------------------


def test_batch_stats_match_a_counter(tmp_path):
    model, optimizer, tel = make_run(tmp_path)
    labels = torch.tensor([0, 1, 1, 1, 2, 2, 1, 0, 1, 1, 1, 2])
    loss, batch = train_step(model, optimizer, y=labels)
    stats = tel.on_batch_end(model, optimizer, 0, 0, batch=batch)["batch_stats"]
    counts = collections.Counter(labels.tolist())
    assert stats["batch_size"] == 12
    assert stats["counts"] == {str(k): v for k, v in sorted(counts.items())}
    for k, v in counts.items():
        assert stats[f"label_{k}_pct"] == pytest.approx(100 * v / 12)


def test_seed_dict_batch_gives_winner_keys(tmp_path):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True))
    batch = {"img1": torch.randn(8, 4), "img2": torch.randn(8, 4), "winner": torch.tensor([1, 1, 1, 0] * 2)}
    optimizer.step()
    stats = tel.on_batch_end(model, optimizer, 0, 0, None, batch)["batch_stats"]  # the positional call
    assert stats["winner_0_pct"] == 25.0 and stats["winner_1_pct"] == 75.0 and stats["batch_size"] == 8


# ---- records --------------------------------------------------------------------------------------


def test_collects_on_batch_idx_and_counts_steps_across_epochs(tmp_path):
    torch.manual_seed(0)
    model = TwoPart()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "run"), collect_every_n=3, strict=True))
    for epoch in range(2):
        for batch_idx in range(1, 8):
            train_step(model, optimizer)
            tel.on_batch_end(model, optimizer, batch_idx, epoch)
    records = read_records(tmp_path / "run")
    assert [(r["epoch"], r["batch_idx"], r["step"]) for r in records] == [
        (0, 3, 3), (0, 6, 6), (1, 3, 10), (1, 6, 13)]


def test_a_second_call_for_the_same_batch_keeps_the_cadence(tmp_path):
    """A loop that calls the hook twice per batch (say, once from a callback and once by hand) collects at
    the same batches as one that calls it once."""
    torch.manual_seed(0)
    model = TwoPart()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "run"), collect_every_n=2, strict=True))
    for batch_idx in range(7):
        train_step(model, optimizer)
        tel.on_batch_end(model, optimizer, batch_idx, 0)
        assert tel.on_batch_end(model, optimizer, batch_idx, 0) is None  # no step since: nothing to collect
    assert [(r["batch_idx"], r["step"]) for r in read_records(tmp_path / "run")] == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_loss_and_scalars_recorded_and_nonfinite_stays_strict_json(tmp_path):
    model, optimizer, tel = make_run(tmp_path)
    train_step(model, optimizer)
    next(model.head.parameters()).grad[0, 0] = float("nan")
    tel.on_batch_end(model, optimizer, 0, 0, loss=torch.tensor(float("inf")), train_acc=torch.tensor(0.75),
                     note="warmup", tokens=1024)
    raw = open(tmp_path / "run" / "telemetry.jsonl").read()
    assert "NaN" not in raw and "Infinity" not in raw
    rec = read_records(tmp_path / "run")[-1]
    assert rec["loss"] is None and rec["train_acc"] == 0.75 and rec["tokens"] == 1024 and rec["note"] == "warmup"
    assert rec["gradient_norm"]["head"] is None and rec["gradient_norm"]["overall"] is None
    assert {"loss", "gradient_norm.overall", "gradient_norm.head"} <= set(rec["nonfinite"])
    assert rec["schema"] == telemetry.SCHEMA_VERSION and rec["telemetry_ms"] > 0


def test_to_host_keeps_shapes_and_integer_types():
    rec = {"a": torch.tensor(1.5), "b": {"c": torch.tensor([[1, 2], [3, 4]]), "d": torch.tensor([True, False])},
           "e": [torch.tensor(2.0), 3]}
    assert telemetry.to_host(rec) == {"a": 1.5, "b": {"c": [[1, 2], [3, 4]], "d": [True, False]}, "e": [2.0, 3]}


# ---- fail-safe ------------------------------------------------------------------------------------


def test_metric_errors_are_recorded_and_warned_once_or_raised_when_strict(tmp_path):
    model, optimizer, _ = make_run(tmp_path)

    def broken_forward(m, b):
        raise RuntimeError("holdout exploded")

    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "lenient"), collect_every_n=1))
    tel.set_holdout_data([(torch.randn(2, 8), torch.tensor([0, 1]))], forward=broken_forward)
    caught = train_collecting(tel, model, optimizer, steps=3)
    relevant = [w for w in caught if "holdout_logits failed" in str(w.message)]
    assert len(relevant) == 1
    records = read_records(tmp_path / "lenient")
    assert len(records) == 3 and all(r["errors"]["holdout_logits"] == "RuntimeError: holdout exploded"
                                     for r in records)
    assert all(r["gradient_norm"]["overall"] > 0 for r in records)

    strict = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "strict"), collect_every_n=1,
                                               strict=True))
    strict.set_holdout_data([(torch.randn(2, 8), torch.tensor([0, 1]))], forward=broken_forward)
    train_step(model, optimizer)
    with pytest.raises(RuntimeError, match="holdout exploded"):
        strict.on_batch_end(model, optimizer, 0, 0)


def test_disabled_writes_nothing(tmp_path):
    model, optimizer, _ = make_run(tmp_path)
    tel = TrainingTelemetry(TelemetryConfig(enabled=False, output_dir=str(tmp_path / "off")))
    train_step(model, optimizer)
    assert tel.on_batch_end(model, optimizer, 0, 0) is None
    assert not (tmp_path / "off").exists()


def test_seed_usage_works_unchanged(tmp_path):
    """The seed's own integration example and analysis snippet, as written there."""
    model, optimizer, _ = make_run(tmp_path)
    telemetry_config = TelemetryConfig(enabled=True, collect_every_n=200, output_dir=tmp_path / "telemetry",
                                       track_gradients=True, track_weight_delta=True, track_learning_rates=True,
                                       track_holdout_logits=True, track_batch_stats=True, holdout_size=50)
    tel = TrainingTelemetry(telemetry_config)
    tel.set_holdout_data([(torch.randn(8, 8), torch.randint(0, 3, (8,))) for _ in range(10)])
    for batch_idx in range(1, 401):
        loss, batch = train_step(model, optimizer)
        tel.on_batch_end(model, optimizer, batch_idx, 0, "cpu", batch)
    metrics = []
    with open(tmp_path / "telemetry" / "telemetry.jsonl") as f:
        for line in f:
            metrics.append(json.loads(line))
    assert [m["batch_idx"] for m in metrics] == [200, 400]
    assert all(m["gradient_norm"]["overall"] > 0 for m in metrics)
    assert len(metrics[0]["holdout_logits"]["labels"]) == 50


def test_imports_with_torch_and_the_standard_library_only():
    blocked = ("yaml", "transformers", "peft", "unsloth", "wandb", "lightning", "matplotlib", "numpy",
               "safetensors", "psutil", "pynvml")
    code = (f"import sys; [sys.modules.__setitem__(m, None) for m in {blocked!r}]; import telemetry; "
            "print(telemetry.TrainingTelemetry.__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "TrainingTelemetry"
