"""Telemetry under torch.distributed: DDP, FSDP2 (fully_shard) and HSDP on 2 CPU processes with gloo.

The reference is a single process training the same global batch (mean loss over all 8 examples, which is
what DDP's and FSDP2's gradient averaging of per-rank means gives). Every distributed run must record the
same numbers, from one telemetry.jsonl written by rank 0. One spawn runs every scenario in sequence.
"""

import datetime
import json
import math
import os
import socket
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from telemetry import TelemetryConfig, TrainingTelemetry, full_gradient, rank_share, replica_weights  # noqa: E402

if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

WORLD = 2
STEPS = 3
TOL = 1e-5
# Sections whose numbers must match the single process (param_change's sparsity/sign-flip counts too:
# with these weights no |dW| sits on a threshold, so a 1e-8 rounding difference cannot flip a count).
COMPARED = ("gradient_norm", "weight_delta", "update_ratio", "drift", "weight_norm", "layer_stats",
            "param_change", "holdout_logits", "learning_rates")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        # Odd sizes: FSDP2 shards dim 0 unevenly (5 -> 3 + 2, 3 -> 2 + 1) and `scale` ([1]) leaves rank 1
        # an empty shard.
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4), torch.nn.Tanh())
        self.head = torch.nn.Linear(4, 3)
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.head(self.body(x)) * self.scale


def data():
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(STEPS, 8, 6, generator=g), torch.randint(0, 3, (STEPS, 8), generator=g)
    hx, hy = torch.randn(7, 6, generator=g), torch.randint(0, 3, (7,), generator=g)
    # 4 and 2 examples split across the 2 ranks; the last batch of 1 cannot be: every rank runs it whole.
    holdout = [(hx[:4], hy[:4]), (hx[4:6], hy[4:6]), (hx[6:], hy[6:])]
    return xs, ys, holdout


def config(out, **overrides):
    base = dict(output_dir=str(out), collect_every_n=1, strict=True, holdout_size=7, track_layer_stats=True,
                track_param_change=True, track_system=False, alerts=False)
    return TelemetryConfig(**{**base, **overrides})


def train(out, mode="single", rank=0, world=1, hook=None, **overrides):
    """3 SGD steps with telemetry at every one; returns what on_batch_end returned on this rank."""
    torch.manual_seed(0)
    model = Net()
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif mode in ("fsdp2", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # HSDP with a shard group of 1: every parameter is (Replicate, Shard) and whole on both ranks,
        # the case where summing over ranks would count everything twice.
        mesh = (init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)) if mode == "fsdp2" else
                init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")))
        for layer in (model.body[0], model.body[2], model.head):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    inner = model.module if mode == "ddp" else model
    optimizer = torch.optim.SGD([{"params": list(inner.body.parameters()), "name": "body"},
                                 {"params": list(inner.head.parameters()) + [inner.scale], "name": "head"}],
                                lr=0.3, momentum=0.9)
    xs, ys, holdout = data()
    telemetry = TrainingTelemetry(config(out, **overrides))
    telemetry.set_holdout_data(holdout)
    share = slice(rank * 8 // world, (rank + 1) * 8 // world)
    records = []
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = xs[step, share], ys[step, share]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if hook is not None:
            hook(step, telemetry, inner, holdout)
        records.append(telemetry.on_batch_end(model, optimizer, step, 0, batch=(x, y), loss=loss))
    telemetry.close()
    return records


def _worker(rank, port, root):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD,
                                         timeout=datetime.timedelta(seconds=60))
    returned = {}
    try:
        for mode in ("ddp", "fsdp2", "hsdp"):
            returned[mode] = train(os.path.join(root, mode), mode, rank, WORLD)
        returned["faults"] = train(os.path.join(root, "faults"), "fsdp2", rank, WORLD, hook=_faults(rank),
                                   strict=False, track_layer_stats=False)
        # strict: a rank-local failure raises on every rank, after the collectives, so none is left waiting.
        try:
            train(os.path.join(root, "strict"), "fsdp2", rank, WORLD, hook=_faults(rank), track_layer_stats=False)
            returned["strict"] = None
        except (RuntimeError, ValueError) as exc:
            returned["strict"] = str(exc)
        # Holdout on rank 0 only, a common mistake: every rank must turn telemetry off, none may hang.
        tel = TrainingTelemetry(config(os.path.join(root, "disagree"), strict=False))
        model = Net()
        from torch.distributed.fsdp import fully_shard
        fully_shard(model)
        if rank == 0:
            tel.set_holdout_data(data()[2])
        model(torch.randn(2, 6)).sum().backward()
        returned["disagree"] = [tel.on_batch_end(model, None, 0, 0), tel.on_batch_end(model, None, 0, 0)]
    finally:
        with open(os.path.join(root, f"returned.rank{rank}.json"), "w") as f:
            json.dump(returned, f)
        torch.distributed.destroy_process_group()
    # Now and then torch's own teardown at interpreter exit aborts the process after a gloo run ("terminate
    # called without an active exception", no Python frame), with or without telemetry: with everything
    # written, the worker leaves without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _faults(rank):
    """Rank-local failures, on rank 1 only: at step 1 a gradient that was never reduced (a Partial DTensor,
    which the gradient pass refuses); at step 2 its weight reference is gone and its holdout forward raises
    after the (collective) model call."""
    def hook(step, telemetry, model, holdout):
        if rank != 1:
            return
        if step == 1:
            from torch.distributed.tensor import DTensor, Partial

            grad = model.scale.grad
            model.scale.grad = DTensor.from_local(grad.to_local(), grad.device_mesh, [Partial()], run_check=False,
                                                  shape=grad.shape, stride=grad.stride())
        if step == 2:
            os.remove(telemetry.checkpoint_file)

            def forward(model, batch):
                model(*batch[:-1])
                raise RuntimeError("injected after the forward")
            telemetry.set_holdout_data(holdout, forward=forward)
    return hook


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    reference = train(root / "single")
    context = torch.multiprocessing.start_processes(_worker, args=(_free_port(), str(root)), nprocs=WORLD,
                                                    join=False, start_method="spawn")
    deadline = time.time() + 150
    while not context.join(timeout=2):
        if time.time() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the distributed run hung")
    returned = [json.loads((root / f"returned.rank{r}.json").read_text()) for r in range(WORLD)]
    return root, reference, returned


def read(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def rel_errors(ref, got, path=""):
    """(max relative error, its dotted path) between two nested records; None must match None."""
    if isinstance(ref, dict):
        assert isinstance(got, dict) and set(ref) == set(got), (path, ref, got)
        return max([rel_errors(ref[k], got[k], f"{path}.{k}") for k in ref], default=(0.0, path))
    if isinstance(ref, list):
        assert isinstance(got, list) and len(ref) == len(got), path
        return max([rel_errors(a, b, f"{path}[{i}]") for i, (a, b) in enumerate(zip(ref, got))],
                   default=(0.0, path))
    if isinstance(ref, bool) or not isinstance(ref, (int, float)):
        assert ref == got, (path, ref, got)
        return 0.0, path
    assert isinstance(got, (int, float)), (path, ref, got)
    # Relative to |ref|, or to 1e-3 for sums that cancel to ~0 (a softmax head's mean gradient, the mean
    # update): their float32 noise is absolute. Every norm compared here is above 1e-2.
    return abs(ref - got) / max(abs(ref), 1e-3), path


@pytest.mark.parametrize("mode", ["ddp", "fsdp2", "hsdp"])
def test_distributed_records_match_one_process(runs, mode):
    root, reference, _ = runs
    got = read(root / mode / "telemetry.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3]
    for ref, rec in zip(reference, got):
        if mode != "ddp":  # under FSDP2 the ranks split the holdout's batches: its probe of one batch is not run
            ref = {**ref, "holdout_logits": {k: v for k, v in ref["holdout_logits"].items() if k != "eval_probe"}}
        for layer, stats in ref["layer_stats"].items():
            # std = sqrt(E[g^2] - E[g]^2) cancels when g is nearly constant: float32 rounding of E[g^2]
            # leaves up to sqrt(float32 eps) ~ 3e-4 of the layer's norm, in any process count.
            if abs(stats["grad_std"] - rec["layer_stats"][layer]["grad_std"]) <= 1e-3 * stats["grad_norm"]:
                rec["layer_stats"][layer]["grad_std"] = stats["grad_std"]
        for section in COMPARED:
            assert (section in ref) == (section in rec), (section, rec.get("errors"))
            if section not in ref:  # param_change at the first collection: nothing changed yet
                assert section == "param_change" and rec["step"] == 1
                continue
            err, where = rel_errors(ref[section], rec[section], section)
            assert err <= TOL, (mode, rec["step"], where, err)
        assert "errors" not in rec
    assert reference[0]["weight_delta"]["overall"] is None and got[1]["weight_delta"]["overall"] > 0
    assert got[-1]["holdout_logits"]["predictions"] == reference[-1]["holdout_logits"]["predictions"]
    assert got[-1]["holdout_logits"]["accuracy"] == reference[-1]["holdout_logits"]["accuracy"]


def test_gradient_norm_matches_an_independent_reference(runs):
    # The single-process reference itself against torch.nn.utils.get_total_norm of a replayed model.
    root, reference, _ = runs
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD([{"params": list(model.body.parameters())},
                                 {"params": list(model.head.parameters()) + [model.scale]}], lr=0.3, momentum=0.9)
    xs, ys, _ = data()
    for step in range(STEPS):
        optimizer.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        torch.nn.functional.cross_entropy(model(xs[step]), ys[step]).backward()
        optimizer.step()
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
        head = torch.nn.utils.get_total_norm([model.head.weight.grad, model.head.bias.grad, model.scale.grad]).item()
        assert math.isclose(reference[step]["gradient_norm"]["overall"], norm, rel_tol=1e-6)
        assert math.isclose(reference[step]["gradient_norm"]["head"], head, rel_tol=1e-6)
        moved = torch.nn.utils.get_total_norm([p.detach() - b for p, b in zip(model.parameters(), before)]).item()
        if step:
            assert math.isclose(reference[step]["weight_delta"]["overall"], moved, rel_tol=1e-5)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2", "hsdp"])
def test_only_rank_0_writes(runs, mode):
    root, _, returned = runs
    files = sorted(os.listdir(root / mode))
    assert [f for f in files if f.endswith(".jsonl")] == ["telemetry.jsonl"]
    info = json.loads((root / mode / "run.json").read_text())
    assert (info["world_size"], info["rank"]) == (WORLD, 0)
    assert len(info["starts"]) == 1  # rank 1 never touched run.json
    if mode == "ddp":
        assert info["parallelism"] == "ddp"
        # Rank 0 alone collects: one weight reference of the whole model, nothing returned on rank 1.
        assert "last_checkpoint.safetensors" in files and not any(".rank" in f for f in files)
        assert returned[1]["ddp"] == [None] * STEPS
    else:
        assert info["parallelism"] == "fsdp2"
        # Each rank keeps the reference of its own shard; nobody holds the whole model's.
        assert {"last_checkpoint.rank0.safetensors", "last_checkpoint.rank1.safetensors"} <= set(files)
        assert "last_checkpoint.safetensors" not in files
        # Rank 1 computes the same (all-reduced) numbers; it just does not write them.
        for r0, r1 in zip(returned[0][mode], returned[1][mode]):
            assert rel_errors(r0["gradient_norm"], r1["gradient_norm"])[0] <= 1e-6
            assert rel_errors(r0["weight_delta"], r1["weight_delta"])[0] <= 1e-6


def test_rank_local_failures_fail_the_section_on_every_rank_without_hanging(runs):
    root, reference, returned = runs
    got = read(root / "faults" / "telemetry.jsonl")
    assert len(got) == STEPS
    assert rel_errors(reference[0]["gradient_norm"], got[0]["gradient_norm"])[0] <= TOL
    # Step 2: rank 1's gradient pass raised; rank 0's was fine, but a partial sum would be wrong.
    assert "gradient_norm" not in got[1] and got[1]["errors"]["gradient_norm"] == "RuntimeError: failed on 1 other rank(s)"
    assert "gradient_norm" not in returned[1]["faults"][1]
    assert rel_errors(reference[1]["weight_delta"], got[1]["weight_delta"])[0] <= TOL
    # Step 3: rank 1 had no reference -> the delta is null everywhere, not rank 0's half of it.
    assert set(got[2]["weight_delta"].values()) == {None}
    assert got[2]["errors"]["holdout_logits"].startswith("RuntimeError: holdout failed on rank 1")
    assert rel_errors(reference[2]["gradient_norm"], got[2]["gradient_norm"])[0] <= TOL


def test_strict_raises_on_every_rank(runs):
    root, _, returned = runs
    assert returned[0]["strict"] == "failed on 1 other rank(s)"
    assert returned[1]["strict"] == "the gradient of scale is Partial (not reduced yet)"
    assert len(read(root / "strict" / "telemetry.jsonl")) == 1  # step 1 was written; step 2 raised


def test_ranks_that_disagree_turn_telemetry_off_together(runs):
    _, _, returned = runs
    # Off for good on both ranks: the second call neither collects nor hangs in a collective.
    assert returned[0]["disagree"] == [None, None] and returned[1]["disagree"] == [None, None]


def test_replica_weights_and_rank_share():
    assert replica_weights([torch.zeros(3), torch.zeros(2, 2)], 4).tolist() == [0.25, 0.25]
    x, y = torch.arange(7), torch.arange(7) * 10
    shares = [rank_share((x, y), r, 3) for r in range(3)]
    assert [s[0][0].tolist() for s in shares] == [[0, 1, 2], [3, 4], [5, 6]] and all(s[1] for s in shares)
    assert torch.equal(torch.cat([s[0][1] for s in shares]), y)
    whole, split = rank_share({"x": x[:1]}, 1, 2)
    assert not split and whole["x"].tolist() == [0]


def test_deepspeed_parameters_without_deepspeed_read_as_absent_gradients():
    # DeepSpeed is not installable here: the import-guarded path must fall back to .grad, and to None
    # (recorded as null) for a ZeRO parameter whose .grad is None.
    try:
        import deepspeed  # noqa: F401
        pytest.skip("deepspeed is installed: this checks the fallback without it")
    except ImportError:
        pass
    plain = torch.nn.Parameter(torch.ones(3))
    plain.grad = torch.full((3,), 2.0)
    zero3 = torch.nn.Parameter(torch.ones(3))
    zero3.ds_id = 7  # what ZeRO-3 sets on the parameters it partitions
    zero3.grad = None
    assert full_gradient(plain) is plain.grad and full_gradient(zero3) is None
    zero3.grad = torch.ones(3)
    assert full_gradient(zero3) is zero3.grad
