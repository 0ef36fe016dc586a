"""Holdouts scored per position: a causal LM's labels are its own input tokens, which the model shifts
itself (position t predicts token t+1); every other per-token target (a tagger's tags, a masked LM's
originals, next tokens shifted already) is scored at its own position, and so is a segmentation's class
per pixel. Each is checked against a manual eval() pass. Data: Python's own source as text, and the
digits of scikit-learn as images."""

import inspect
import json
import os
import sys

import pytest
import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from telemetry import TelemetryConfig, TrainingTelemetry  # noqa: E402


def text_windows(n=96, length=24):
    """Characters of argparse's source as ids (< 128), in n windows of `length`."""
    import argparse
    codes = torch.tensor([min(ord(c), 127) for c in inspect.getsource(argparse)[:n * length]])
    return codes.reshape(n, length)


def char_kind(ids):
    """A tag per character: 0 letter, 1 digit, 2 space, 3 anything else."""
    chars = [[chr(int(c)) for c in row] for row in ids]
    return torch.tensor([[0 if c.isalpha() else 1 if c.isdigit() else 2 if c.isspace() else 3 for c in row]
                         for row in chars])


class Tagger(nn.Module):
    def __init__(self, classes):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(128, 16)
        self.rnn = nn.GRU(16, 16, batch_first=True)
        self.head = nn.Linear(16, classes)

    def forward(self, input_ids):
        return self.head(self.rnn(self.emb(input_ids))[0])


def manual(model, ids, targets, shift):
    """Token accuracy and mean NLL over supervised positions, from a plain eval() pass."""
    model.eval()
    with torch.no_grad():
        logits = model(ids).double()
    model.train()
    if shift:
        logits, targets = logits[:, :-1], targets[:, 1:]
    kept = targets != -100
    nll = nn.functional.cross_entropy(logits[kept], targets[kept])
    return (logits.argmax(-1)[kept] == targets[kept]).double().mean().item(), nll.item()


def train(tmp_path, model, batches, holdout, steps=20):
    run = str(tmp_path / "run")
    tel = TrainingTelemetry(TelemetryConfig(output_dir=run, collect_every_n=1, strict=True, holdout_size=32))
    tel.set_holdout_data(holdout)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    records = []
    for i in range(steps):
        ids, targets = batches[i % len(batches)]
        logits = model(ids)
        if isinstance(holdout, dict) and holdout["labels"] is holdout["input_ids"]:  # a causal LM's own loss
            logits, targets = logits[:, :-1], targets[:, 1:]
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        opt.step()
        records.append(tel.on_batch_end(model, opt, i, 0, batch=(ids, targets), loss=loss))
        opt.zero_grad()
    tel.close()
    return records


@pytest.mark.parametrize("task", ["tagger", "next tokens shifted already", "causal LM's own tokens"])
def test_per_token_holdouts_score_each_position_against_its_own_target(tmp_path, task):
    ids = text_windows()
    if task == "tagger":
        targets = char_kind(ids)
        targets[:, :4] = -100  # positions a tagger's loss skips (padding, special tokens)
        model, shift = Tagger(4), False
    elif task == "next tokens shifted already":  # nanoGPT's (x, y) = (ids[:-1], ids[1:])
        ids, targets = ids[:, :-1], ids[:, 1:].clone()
        model, shift = Tagger(128), False
    else:
        targets = ids
        model, shift = Tagger(128), True
    batches = [(ids[i:i + 16], targets[i:i + 16]) for i in range(32, 96, 16)]
    holdout = {"input_ids": ids[:32], "labels": targets[:32]}
    records = train(tmp_path, model, batches, holdout, steps=20 if task == "tagger" else 120)
    section = records[-1]["holdout_logits"]
    accuracy, loss = manual(model, ids[:32], targets[:32], shift)
    assert section["kind"] == "lm" and section["shifted"] is shift
    assert section["accuracy"] == pytest.approx(accuracy, rel=1e-6)
    assert section["loss"] == pytest.approx(loss, rel=1e-4)
    other, _ = manual(model, ids[:32], targets[:32], not shift)
    assert abs(accuracy - other) > 0.05  # the other alignment would be told apart


def test_a_masked_lm_and_a_token_classifier_from_transformers(tmp_path):
    """BertForMaskedLM (labels are the originals at masked positions, -100 elsewhere) and
    BertForTokenClassification (tags, -100 at padding) are scored unshifted: accuracy and loss against the
    model's own loss and an eval() pass."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32, num_labels=4)
    ids = text_windows(64, 24)
    gen = torch.Generator().manual_seed(0)
    masked = torch.rand(ids.shape, generator=gen) < 0.3
    tasks = {"mlm": (transformers.BertForMaskedLM, ids.masked_fill(masked, 0), torch.where(masked, ids, -100)),
             "tags": (transformers.BertForTokenClassification, ids, char_kind(ids).masked_fill(ids == 32, -100))}
    for name, (cls, inputs, labels) in tasks.items():
        torch.manual_seed(0)
        model = cls(config)
        run = str(tmp_path / name)
        tel = TrainingTelemetry(TelemetryConfig(output_dir=run, collect_every_n=1, strict=True, holdout_size=32))
        tel.set_holdout_data({"input_ids": inputs[:32], "labels": labels[:32]})
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        for i in range(8):
            batch = {"input_ids": inputs[32:], "labels": labels[32:]}
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            section = tel.on_batch_end(model, opt, i, 0, batch=batch, loss=loss)["holdout_logits"]
            opt.zero_grad()
        tel.close()
        model.eval()
        with torch.no_grad():
            out = model(input_ids=inputs[:32], labels=labels[:32])
        kept = labels[:32] != -100
        accuracy = (out.logits.argmax(-1)[kept] == labels[:32][kept]).double().mean().item()
        assert section["shifted"] is False, name
        assert section["loss"] == pytest.approx(out.loss.item(), rel=1e-4), name
        assert section["accuracy"] == pytest.approx(accuracy, rel=1e-6), name


@pytest.mark.parametrize("masks", ["classes [N, H, W]", "binary [N, 1, H, W]", "binary [N, H, W]"])
def test_a_segmentations_pixels_are_scored_as_positions(tmp_path, masks):
    """A convolutional segmenter of the digits' pixels (background, faint, bright; or bright or not, one
    logit against 0/1 float masks and BCE): holdout accuracy and loss per pixel against an eval() pass."""
    datasets = pytest.importorskip("sklearn.datasets")
    images = torch.tensor(datasets.load_digits().data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16
    binary = masks.startswith("binary")
    labels = (images[:, 0] > 0.6).float() if binary else (images[:, 0] > 0.1).long() + (images[:, 0] > 0.6).long()
    if masks == "binary [N, 1, H, W]":
        labels = labels[:, None]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1 if binary else 3, 1))

    def loss_of(logits, target):
        if binary:
            return nn.functional.binary_cross_entropy_with_logits(logits.reshape(target.shape), target)
        return nn.functional.cross_entropy(logits, target)

    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True))
    tel.set_holdout_data((images[:50], labels[:50]))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for i in range(10):
        part = slice(50 + i * 32, 50 + (i + 1) * 32)
        loss = loss_of(model(images[part]), labels[part])
        loss.backward()
        opt.step()
        section = tel.on_batch_end(model, opt, i, 0, batch=(images[part], labels[part]), loss=loss)["holdout_logits"]
        opt.zero_grad()
    tel.close()
    model.eval()
    with torch.no_grad():
        logits = model(images[:50]).double()
    target = labels[:50].double() if binary else labels[:50]
    predicted = (logits.reshape(target.shape) > 0).double() if binary else logits.argmax(1)
    assert section["accuracy"] == pytest.approx((predicted == target).double().mean().item(), rel=1e-6)
    assert section["loss"] == pytest.approx(loss_of(logits, target).item(), rel=1e-4)
    assert section["tokens"] == [64] * 50  # the pixels of each image
    with open(tmp_path / "run.json") as f:  # a token sequence's chance level is no segmentation's
        assert "token_entropy" not in json.load(f)["holdout"]
