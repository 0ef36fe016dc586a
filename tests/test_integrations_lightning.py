"""The Lightning callback: a tiny LightningModule trained on the CPU by lightning.pytorch's Trainer.

References are Lightning's own: lightning.pytorch.utilities.grad_norm taken by the module in its
on_before_optimizer_step (after unscaling, before clipping), the loss its training_step returned, and
weight copies the module keeps after each step.
"""

import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from telemetry import TelemetryConfig, TrainingTelemetry  # noqa: E402

pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (a dev extra)")
from lightning.pytorch.utilities import grad_norm  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(5, 4)
        self.head = torch.nn.Linear(4, 3)
        self.norms, self.losses, self.weights, self.accuracies, self.lrs = [], [], [], [], []

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        self.losses.append(loss.item())
        accuracy = (logits.argmax(-1) == y).float().mean()
        self.accuracies.append(accuracy.item())
        self.log("train_acc", accuracy, on_step=True, on_epoch=False)
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.norms.append(grad_norm(self, norm_type=2)["grad_2.0_norm_total"].item())
        self.lrs.append({g["name"]: g["lr"] for g in optimizer.param_groups})

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.weights.append([p.detach().clone() for p in self.parameters()])

    def configure_optimizers(self):
        return torch.optim.SGD([{"params": self.body.parameters(), "name": "body"},
                                {"params": self.head.parameters(), "name": "head"}], lr=0.5)


def fit(tmp_path, module_class=None, **trainer_args):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(24, 5, generator=g), torch.randint(0, 3, (24,), generator=g))
    module = (module_class or Tiny)()
    telemetry = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "run"), collect_every_n=2, strict=True,
                                                  alerts=False, track_system=False))
    telemetry.set_holdout_data(list(torch.utils.data.DataLoader(data, batch_size=8))[:1])
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[telemetry.lightning_callback()], **trainer_args)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    records = [json.loads(line) for line in open(tmp_path / "run" / "telemetry.jsonl")]
    return module, records, trainer


def test_lightning_records_lightnings_own_gradient_norm(tmp_path):
    # Clipping at 0.05 changes the gradients after on_before_optimizer_step: the record must hold the
    # pre-clip norm that Lightning's grad_norm reports there, not the clipped one.
    module, records, _ = fit(tmp_path, gradient_clip_val=0.05)
    assert [r["batch_idx"] for r in records] == [0, 2, 4]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["clip_grad_norm"] == 0.05
    assert max(module.norms) > 0.1
    for record in records:
        b = record["batch_idx"]
        assert math.isclose(record["gradient_norm"]["overall"], module.norms[b], rel_tol=1e-6)
        assert math.isclose(record["loss"], module.losses[b], rel_tol=1e-6)
        assert set(record["gradient_norm"]) == {"overall", "body", "head"}
        assert record["learning_rates"] == {"overall": 0.5, "body": 0.5, "head": 0.5}
        assert 0.0 <= record["holdout_logits"]["accuracy"] <= 1.0
    for record in records[1:]:
        b = record["batch_idx"]
        moved = torch.nn.utils.get_total_norm(
            [now - before for now, before in zip(module.weights[b], module.weights[b - 2])]).item()
        assert math.isclose(record["weight_delta"]["overall"], moved, rel_tol=1e-5)


def test_lightning_16_mixed_records_the_scaler_and_unscaled_norms(tmp_path):
    from lightning.pytorch.plugins import MixedPrecision

    module, records, trainer = fit(tmp_path, plugins=[MixedPrecision("16-mixed", "cpu")])
    scaler = trainer.precision_plugin.scaler
    assert isinstance(scaler, torch.amp.GradScaler) and len(records) == 3
    for record in records:
        # Lightning unscales before on_before_optimizer_step, where the module took its reference.
        assert math.isclose(record["gradient_norm"]["overall"], module.norms[record["batch_idx"]], rel_tol=1e-5)
    # No step overflowed (the scale never backed off from its initial 2**16), and the record says so.
    assert scaler.get_scale() == 2.0 ** 16
    assert [r["grad_scaler"] for r in records] == [{"scale": 2.0 ** 16, "skipped_steps": 0}] * 3


def test_accumulated_batches_are_recorded_only_at_optimizer_steps(tmp_path):
    # 6 batches, 2 per optimizer step: steps end at batch_idx 1, 3, 5, and Lightning's own gradient norm
    # (taken in on_before_optimizer_step, once per step) is the whole accumulated gradient's.
    module, records, _ = fit(tmp_path, accumulate_grad_batches=2)
    assert [r["batch_idx"] for r in records] == [1, 3, 5] and [r["step"] for r in records] == [1, 2, 3]
    # both micro-batches' backward() added into the gradients the step took: nothing for the analyzer to name
    assert all(r["accumulation"]["micro_batches"] == 2 <= r["accumulation"]["backward_bound"] for r in records)
    assert len(module.norms) == 3
    for record, norm in zip(records, module.norms):
        assert math.isclose(record["gradient_norm"]["overall"], norm, rel_tol=1e-6)


class Scheduled(Tiny):
    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_the_lr_a_step_used_and_the_loss_of_its_micro_batches(tmp_path):
    """Lightning steps the scheduler before on_train_batch_end: the record still holds the lr each group had
    when the optimizer stepped (read by the module in on_before_optimizer_step), and the training goes on
    with the scheduler's. With 2 batches per step, the loss is their mean, as the step's backward()s saw it."""
    module, records, trainer = fit(tmp_path, Scheduled, accumulate_grad_batches=2)
    assert [r["step"] for r in records] == [1, 2, 3] and len(module.lrs) == 3
    for k, record in enumerate(records):
        used = module.lrs[k]
        assert record["learning_rates"] == pytest.approx({"overall": max(used.values()), **used})
        b = record["batch_idx"]
        assert math.isclose(record["loss"], (module.losses[b - 1] + module.losses[b]) / 2, rel_tol=1e-6)
    assert [g["lr"] for g in trainer.optimizers[0].param_groups] == [0.5 * 0.5 ** 3] * 2


def test_what_self_log_records_reaches_the_record(tmp_path):
    module, records, _ = fit(tmp_path)
    for record in records:
        assert math.isclose(record["train_acc"], module.accuracies[record["batch_idx"]], rel_tol=1e-6)


class TwoOptimizers(Tiny):
    """Manual optimization with an optimizer for the body and one for the head, as GANs and some fine-tunes
    do: the callback passes both, and the records hold each one's learning rate."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        body, head = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        body.zero_grad()
        head.zero_grad()
        self.manual_backward(loss)
        self.norms.append(grad_norm(self, norm_type=2)["grad_2.0_norm_total"].item())
        body.step()
        head.step()
        return loss

    def on_before_optimizer_step(self, optimizer):
        pass  # the norm is taken once per batch, in training_step

    def configure_optimizers(self):
        return [torch.optim.SGD(self.body.parameters(), lr=0.5), torch.optim.Adam(self.head.parameters(), lr=0.01)]


def test_two_optimizers_in_manual_optimization_are_both_recorded(tmp_path):
    module, records, _ = fit(tmp_path, TwoOptimizers)
    info = json.loads(open(tmp_path / "run" / "run.json").read())
    assert info["optimizer"] == "SGD+Adam" and "not_in_optimizer" not in info
    assert [r["batch_idx"] for r in records] == [0, 2, 4] and [r["step"] for r in records] == [1, 3, 5]
    for record in records:
        assert record["learning_rates"]["group_0"] == 0.5 and record["learning_rates"]["group_1"] == 0.01
        assert math.isclose(record["gradient_norm"]["overall"], module.norms[record["batch_idx"]], rel_tol=1e-6)


class TwoLosses(TwoOptimizers):
    """Manual optimization as a GAN does it: each optimizer steps on a backward of its own loss. Each one's
    gradient norm is taken by the module right before its step."""

    def __init__(self):
        super().__init__()
        self.own = []  # per batch: (the body's norm before its step, the head's before its)

    def training_step(self, batch, batch_idx):
        body, head = self.optimizers()
        x, y = batch
        body.zero_grad()
        head.zero_grad()
        self.manual_backward(torch.nn.functional.cross_entropy(self(x), y))
        before_body = torch.nn.utils.get_total_norm([p.grad for p in self.body.parameters()]).item()
        body.step()
        body.zero_grad()
        head.zero_grad()
        loss = torch.nn.functional.cross_entropy(self(x), (y + 1) % 3)  # another loss, another gradient
        self.manual_backward(loss)
        self.own.append((before_body, torch.nn.utils.get_total_norm([p.grad for p in self.head.parameters()]).item()))
        head.step()
        return loss


def test_optimizers_stepping_on_losses_of_their_own_each_keep_their_gradient(tmp_path):
    module, records, _ = fit(tmp_path, TwoLosses)
    assert [r["batch_idx"] for r in records] == [0, 2, 4]
    for record in records:
        body, head = module.own[record["batch_idx"]]
        assert math.isclose(record["gradient_norm"]["group_0"], body, rel_tol=1e-6)
        assert math.isclose(record["gradient_norm"]["group_1"], head, rel_tol=1e-6)
        assert math.isclose(record["gradient_norm"]["overall"], math.hypot(body, head), rel_tol=1e-6)


def test_an_epochs_last_shorter_step_records_its_mean_loss(tmp_path):
    """6 batches, 4 per optimizer step: the epoch's second step holds 2 micro-batches, whose losses
    Lightning still divides by 4. The record holds their mean (2x what the backward()s added up to), as for
    the whole steps, against the losses training_step returned."""
    module, records, _ = fit(tmp_path, accumulate_grad_batches=4)
    assert [r["batch_idx"] for r in records] == [3, 5]
    for record, losses in zip(records, [module.losses[:4], module.losses[4:]]):
        assert math.isclose(record["loss"], sum(losses) / len(losses), rel_tol=1e-6)


class Started(Tiny):
    def on_train_start(self):
        self.start = [p.detach().clone() for p in self.parameters()]


def test_drift_counts_the_first_step(tmp_path):
    """The callback keeps W_0 when training starts: drift is the distance from the weights before the first
    step, against the module's own copies."""
    module, records, _ = fit(tmp_path, Started)
    for record in records:
        moved = torch.nn.utils.get_total_norm(
            [now - before for now, before in zip(module.weights[record["batch_idx"]], module.start)]).item()
        assert moved > 0 and math.isclose(record["drift"]["overall"], moved, rel_tol=1e-5)
