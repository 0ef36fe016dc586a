"""On a CUDA device (skipped without one, as in CI): a collection's numbers against float64 sums of weight copies
the test kept and of gradient copies; the reference file written from the device, bit for bit, through the
pinned buffers, also when the loop trains on a stream of its own. TELEMETRY_TEST_DEVICE=cpu runs the same checks on the CPU."""
import contextlib
import os

import pytest
import torch
from torch import nn

import telemetry
from telemetry import TelemetryConfig, TrainingTelemetry

DEVICE = os.environ.get("TELEMETRY_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU")


def big_model():
    """50 MB of float32: several blocks on a GPU, chunked on the CPU, and written beside the pass."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)).to(DEVICE)


def train(model, opt, tel, steps, start=0):
    out = []
    for step in range(start, start + steps):
        before = [p.detach().double().cpu() for p in model.parameters()]
        nn.functional.cross_entropy(model(torch.randn(16, 2048, device=DEVICE)),
                                    torch.randint(0, 10, (16,), device=DEVICE)).backward()
        grad_norm = torch.cat([p.grad.double().reshape(-1) for p in model.parameters()]).norm().item()
        opt.step()
        rec = tel.on_batch_end(model, opt, step, 0)
        out.append((rec, before, [p.detach().double().cpu() for p in model.parameters()], grad_norm))
        opt.zero_grad()
    return out


def check(records):
    for rec, before, after, grad_norm in records:
        delta = torch.cat([(a - b).reshape(-1) for a, b in zip(after, before)]).norm().item()
        norm = torch.cat([a.reshape(-1) for a in after]).norm().item()
        assert rec["weight_delta"]["overall"] == pytest.approx(delta, rel=1e-5)
        assert rec["weight_norm"]["overall"] == pytest.approx(norm, rel=1e-5)
        # float32 sums over 12.6M gradients: torch.nn.utils.get_total_norm itself is off float64 by 1e-4 on a CPU
        assert rec["gradient_norm"]["overall"] == pytest.approx(grad_norm, rel=2e-4)


def reference_is(tmp_path, model):
    """Whether the reference file holds the model's trainable weights, bit for bit."""
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / telemetry.REFERENCE_FILE))
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    return saved.keys() == trained.keys() and all(torch.equal(saved[n], p.detach().cpu()) for n, p in trained.items())


def test_device_collections_match_float64_copies(tmp_path, monkeypatch):
    """Block by block on a GPU (several blocks of DEVICE_BLOCK_BYTES here), where no fused kernel is asked for
    even with TELEMETRY_COMPILE=1: the pass waits on the host, not on the device's sums."""
    monkeypatch.setenv("TELEMETRY_COMPILE", "1")
    monkeypatch.setattr(telemetry, "_FUSED", telemetry._FusedKernels())
    model = big_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True))
    check(train(model, opt, tel, 4)[1:])  # the first has no delta
    assert reference_is(tmp_path, model)
    if DEVICE.startswith("cuda"):
        assert not telemetry._FUSED.wanted and not telemetry._FUSED.kernels
    tel.close()


def test_training_on_a_stream_of_its_own_writes_the_weights_of_this_step(tmp_path):
    model = big_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True))
    side = torch.cuda.Stream() if DEVICE.startswith("cuda") else None
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for step in range(4):
            x = torch.randn(256, 2048, device=DEVICE)
            for _ in range(20):  # a long queue of work on the side stream before the hook runs
                x = torch.tanh(model[0](x))
            model(x).square().mean().backward()
            opt.step()
            tel.on_batch_end(model, opt, step, 0)
            opt.zero_grad()
            assert reference_is(tmp_path, model), step
    tel.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_chunks_are_the_tensors_bytes(dtype):
    per_chunk = telemetry.CHUNK_BYTES // torch.tensor([], dtype=dtype).element_size()
    t = torch.randn(5 * per_chunk // 2 + 7, device=DEVICE).to(dtype)
    got = b"".join(bytes(chunk) for chunk in telemetry._host_chunks(t))
    assert got == t.cpu().view(torch.uint8).numpy().tobytes()


def test_lora_on_the_device_matches_peft_delta_weights(tmp_path):
    """Adapters of several shapes (rank 8 on q_proj and down_proj, 2 on v_proj): stacked per shape on the
    device, against peft's get_delta_weight, float64 products of the factors the test kept and their SVDs; the weight
    pass (many adapters to a block) against float64 copies, and the reference file bit for bit."""
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=4, vocab_size=256))
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, rank_pattern={"v_proj": 2},
                                                      target_modules=["q_proj", "v_proj", "down_proj"])).to(DEVICE)
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    with torch.no_grad():
        for _, m in layers:
            m.lora_B["default"].weight.normal_(0, 0.1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True))

    def dense():
        return {n: m.scaling["default"] * m.lora_B["default"].weight.detach().double().cpu()
                @ m.lora_A["default"].weight.detach().double().cpu() for n, m in layers}
    trained = [p for p in model.parameters() if p.requires_grad]
    for step in range(3):
        before, kept = dense(), [p.detach().double().cpu() for p in trained]
        ids = torch.randint(0, 256, (2, 16), device=DEVICE)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        rec = tel.on_batch_end(model, opt, step, 0)
        lora = rec["lora"]
        opt.zero_grad()
        peft_sq = sum(float(m.get_delta_weight("default").double().square().sum()) for _, m in layers)
        assert reference_is(tmp_path, model)  # two dozen small adapter tensors, written as runs
        assert lora["adapter_norm"]["overall"] == pytest.approx(peft_sq ** 0.5, rel=1e-5)
        sv = [torch.linalg.svdvals(d) for d in dense().values()]  # stable ranks from the device's eigensolves
        ranks = sorted(float(s.square().sum() / s[0] ** 2) for s in sv)
        assert [lora["stable_rank"][k] for k in ("min", "max")] == pytest.approx([ranks[0], ranks[-1]], rel=1e-9)
        if step:
            after = dense()
            delta = sum(float((after[n] - before[n]).square().sum()) for n in after) ** 0.5
            assert lora["adapter_delta"]["overall"] == pytest.approx(delta, rel=1e-6)
            moved = sum(float((p.detach().double().cpu() - k).square().sum()) for p, k in zip(trained, kept)) ** 0.5
            assert rec["weight_delta"]["overall"] == pytest.approx(moved, rel=1e-5)  # the pass's blocks
    tel.close()
