"""Language-model runs of the diagnosis corpus: a character-level GRU on Python's own standard-library source,
in a plain loop with dict batches, and a tiny Llama with LoRA adapters through transformers.Trainer and
telemetry.hf_callback() (as example_train.py's train_lora, smaller and shorter)."""

from __future__ import annotations

import math
import os
from functools import lru_cache
from typing import Any, Dict

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from workloads import TelemetryConfig, TrainingTelemetry, Verdict, _identical, _snapshot, collect_every

# ---- Character-level LM on standard-library source ----------------------------------------------------
# Three modules to train on, 50 windows of a fourth for telemetry's holdout, two more for the test set.
TRAIN_FILES = ("argparse.py", "inspect.py", "typing.py")
HOLDOUT_FILE = "textwrap.py"
TEST_FILES = ("pathlib.py", "difflib.py")
VOCAB = 128  # ASCII; anything else maps to 0
SEQ = 64


@lru_cache(maxsize=None)
def _text_ids(names: tuple) -> torch.Tensor:
    stdlib = os.path.dirname(os.__file__)
    text = "".join(open(os.path.join(stdlib, n), encoding="utf-8").read() for n in names)
    ids = np.frombuffer(text.encode("ascii", "replace"), dtype=np.uint8).astype(np.int64)
    return torch.from_numpy(np.where(ids < VOCAB, ids, 0))


def _windows(ids: torch.Tensor, n: int, length: int, start: int = 0) -> torch.Tensor:
    """n non-overlapping windows of `length` characters from `start` on; a start past where n windows fit wraps
    round the text (high seeds), so that there are always n where the text holds them."""
    if start + n * length > len(ids):
        start %= max(len(ids) - n * length + 1, 1)
    n = min(n, (len(ids) - start) // length)
    return ids[start:start + n * length].reshape(n, length)


class CharGRU(nn.Module):
    def __init__(self, vocab: int = VOCAB, embed: int = 32, hidden: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.rnn = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(input_ids))[0])


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-character cross-entropy, shifted as HF causal LMs do (position t predicts token t+1)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def bigram_nll(train: torch.Tensor, test: torch.Tensor, alpha: float = 0.1) -> float:
    """Test NLL (nats/char) of a smoothed bigram model counted on the train text: the level to beat."""
    counts = torch.full((VOCAB, VOCAB), alpha, dtype=torch.float64)
    counts.index_put_((train[:-1], train[1:]), torch.ones(len(train) - 1, dtype=torch.float64), accumulate=True)
    logp = (counts / counts.sum(1, keepdim=True)).log()
    return float(-logp[test[:-1], test[1:]].mean())


def unigram_nll(train: torch.Tensor, test: torch.Tensor, alpha: float = 0.1) -> float:
    """Test NLL (nats/char) of each character's smoothed frequency in the train text: what a model that ignores
    the context can reach."""
    counts = torch.full((VOCAB,), alpha, dtype=torch.float64).index_add_(0, train, torch.ones(len(train),
                                                                                               dtype=torch.float64))
    return float(-(counts / counts.sum()).log()[test[1:]].mean())


def test_nll(model: nn.Module, windows: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        loss = float(lm_loss(model(windows), windows))
    model.train()
    return loss


def copy_share(model: nn.Module, windows: torch.Tensor) -> float:
    """The share of positions whose top prediction is the character at that very position (a manual eval
    pass): near 1 for a model that learned to copy its input."""
    model.eval()
    with torch.no_grad():
        share = float((model(windows).argmax(-1) == windows).float().mean())
    model.train()
    return share


def train_char_lm(spec: Dict[str, Any], out_dir: str, seed: int) -> Dict[str, Any]:
    torch.manual_seed(seed)
    rng = np.random.RandomState(seed)
    train_ids = _text_ids(TRAIN_FILES)
    holdout = _windows(_text_ids((HOLDOUT_FILE,)), 50, SEQ, start=1000 * seed)
    test_all = _text_ids(TEST_FILES)
    test_windows = _windows(test_all, 10_000, 2 * SEQ)      # the whole test text, for the final number
    test_curve = test_windows[rng.permutation(len(test_windows))[:64]]  # a sample, for the curve

    model = CharGRU()
    start = _snapshot(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.01)
    steps, bs = spec["steps"], spec["batch"]
    every = collect_every(steps)
    telemetry = TrainingTelemetry(TelemetryConfig(output_dir=out_dir, collect_every_n=every, holdout_size=50))
    telemetry.set_holdout_data({"input_ids": holdout, "labels": holdout})
    plant = spec.get("plant")
    if plant == "shuffled_tokens":  # the loader bug: the text shuffled character by character, not by window
        train_ids = train_ids[torch.from_numpy(rng.permutation(len(train_ids)))]
    starts = rng.randint(0, len(train_ids) - SEQ, size=(steps, bs))
    if plant == "repeated_batch":
        starts[:] = starts[0]  # the loader bug: the same batch every step
    curve, keys = [], set()
    for step in range(1, steps + 1):
        ids = torch.stack([train_ids[s:s + SEQ] for s in starts[step - 1]])
        keys.add(hash(starts[step - 1].tobytes()))
        batch = {"input_ids": ids, "labels": ids}
        logits = model(batch["input_ids"])
        if plant == "labels_not_shifted":  # the bug: position t scored against token t, so the model copies
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
        else:
            loss = lm_loss(logits, batch["labels"])
        loss.backward()
        optimizer.step()
        telemetry.on_batch_end(model, optimizer, step, 0, batch=batch, loss=loss)
        optimizer.zero_grad()
        if step % (4 * every) == 0 or step == steps:
            curve.append(test_nll(model, test_curve))
    telemetry.close()
    final = test_nll(model, test_windows)
    if plant == "labels_not_shifted":
        copied, bigram = copy_share(model, test_windows), bigram_nll(train_ids, test_all)
        verdict = Verdict(copied >= 0.9 and final > bigram, f"copies {copied:.0%}, test NLL {final:.3f}",
                          f"top prediction = the input character at the same position for {copied:.1%} of the test "
                          f"positions (needs >= 90%); next-character test NLL {final:.3f} vs a bigram model's "
                          f"{bigram:.3f} (needs more)")
    elif plant == "shuffled_tokens":
        counted = unigram_nll(train_ids, test_all)
        verdict = Verdict(final >= 0.98 * counted, f"test NLL {final:.3f}",
                          f"test NLL {final:.3f} nats/char vs {counted:.3f} for the characters' frequencies in the "
                          "train text (needs >= 0.98x: no better than ignoring the context)")
    elif plant == "repeated_batch":
        verdict = Verdict(len(keys) == 1, f"{len(keys)} distinct batch",
                          f"{len(keys)} distinct batch(es) over {steps} steps (needs 1); test NLL {final:.3f}")
    else:
        bigram = bigram_nll(train_ids, test_all)
        ok = final <= bigram and curve[-1] <= 1.1 * min(curve) and not _identical(model, start)
        verdict = Verdict(ok, f"test NLL {final:.3f}",
                          f"test NLL {final:.3f} nats/char on {test_windows.numel():,} characters of "
                          f"{', '.join(TEST_FILES)} vs a bigram model's {bigram:.3f} (needs <=); curve end "
                          f"{curve[-1]:.3f} vs best {min(curve):.3f} (needs <= 1.1x)",
                          {"test_nll": final, "bigram_nll": bigram})
    return {"collect_every_n": every, "steps": steps, "verdict": verdict}


# ---- A tiny Llama on lines of standard-library source, padded on the left ----------------------------------
LINE = 48  # characters a line keeps; shorter lines are padded before their text with 0


@lru_cache(maxsize=None)
def _padded_lines(names: tuple, seed: int) -> tuple:
    """The files' lines of over 12 characters, shuffled: (ids [lines, LINE] padded on the left with 0,
    attention mask, labels: the ids, -100 on padding)."""
    stdlib = os.path.dirname(os.__file__)
    lines = [line.strip() for n in names for line in open(os.path.join(stdlib, n), encoding="utf-8")
             if len(line.strip()) > 12]
    lines = [lines[i] for i in np.random.RandomState(seed).permutation(len(lines))]
    ids = torch.zeros(len(lines), LINE, dtype=torch.long)
    for i, line in enumerate(lines):
        text = [min(ord(c), VOCAB - 1) or 1 for c in line[:LINE]]  # 0 is padding: no character maps there
        ids[i, LINE - len(text):] = torch.tensor(text)
    mask = (ids > 0).long()
    return ids, mask, ids.masked_fill(mask == 0, -100)


class MaskDropped(nn.Module):
    """A wrapper whose forward takes attention_mask and never passes it on: every line is read after its
    padding."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.lm(input_ids=input_ids, labels=labels)


def lines_alone(lm: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> list:
    """Each line's mean next-character NLL with the line alone, unpadded (a manual eval pass)."""
    lm.eval()
    with torch.no_grad():
        out = []
        for row, keep in zip(ids, mask.bool()):
            x = row[keep][None]
            out.append(float(F.cross_entropy(lm(input_ids=x).logits[0, :-1], x[0, 1:])))
    lm.train()
    return out


def lines_padded(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> list:
    """Each line's mean NLL over the same positions, the lines in one padded batch as the loop gives them."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    model.train()
    out = []
    for row, keep, x in zip(logits, mask.bool(), ids):
        out.append(float(F.cross_entropy(row[keep][:-1], x[keep][1:])))
    return out


def train_padded_lm(spec: Dict[str, Any], out_dir: str, seed: int) -> Dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    ids, mask, labels = _padded_lines(TRAIN_FILES, seed)
    hold = [t[:50] for t in _padded_lines((HOLDOUT_FILE,), seed)]
    test = [t[:200] for t in _padded_lines(TEST_FILES, 0)]
    lm = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB))
    plant = spec.get("plant")
    model = MaskDropped(lm) if plant == "padding_read" else lm
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    steps, bs = spec["steps"], spec["batch"]
    every = collect_every(steps)
    telemetry = TrainingTelemetry(TelemetryConfig(output_dir=out_dir, collect_every_n=every, holdout_size=50))
    telemetry.set_holdout_data({"input_ids": hold[0], "attention_mask": hold[1], "labels": hold[2]})
    rng = np.random.RandomState(seed)
    for step in range(1, steps + 1):
        pick = torch.from_numpy(rng.randint(0, len(ids), size=bs))
        batch = {"input_ids": ids[pick], "attention_mask": mask[pick], "labels": labels[pick]}
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        telemetry.on_batch_end(model, optimizer, step, 0, batch=batch, loss=loss)
        optimizer.zero_grad()
    telemetry.close()
    alone = lines_alone(lm, test[0], test[1])
    padded = lines_padded(model, test[0], test[1])
    short = (test[1] == 0).sum(1).numpy() >= LINE // 2  # lines at least half padding, as the probe's row is
    gaps = np.array([abs(p - a) / a for p, a in zip(padded, alone)])
    gap = float(np.median(gaps[short]))
    final = float(np.average(alone, weights=test[1].sum(1).numpy() - 1))
    if plant == "padding_read":
        verdict = Verdict(gap > 0.01, f"padded/alone {gap:.1%}",
                          f"the median NLL of the {int(short.sum())} test lines at least half padding, in a "
                          f"left-padded batch and alone, differ by {gap:.2%} (needs > 1%: the padding is read); "
                          f"test NLL alone {final:.3f}")
    else:
        counted = unigram_nll(ids[mask.bool()], test[0][test[1].bool()])
        verdict = Verdict(gap < 1e-4 and final < counted, f"test NLL {final:.3f}",
                          f"test NLL {final:.3f} nats/char over 200 lines of {', '.join(TEST_FILES)}, each alone, "
                          f"vs {counted:.3f} for the characters' frequencies (needs less); padded/alone "
                          f"{gap:.1e} (needs < 1e-4)", {"test_nll": final, "unigram_nll": counted})
    return {"collect_every_n": every, "steps": steps, "verdict": verdict}


# ---- LoRA through transformers.Trainer ----------------------------------------------------------------

def answer_nll(model, dataset) -> tuple:
    """(mean NLL per answer token, exact-match accuracy of the answers) with the model in eval mode."""
    batch = {k: torch.stack([x[k] for x in dataset.items]) for k in dataset.items[0]}
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits, target = logits[:, :-1].float(), batch["labels"][:, 1:]
    valid = target != -100
    nll = F.cross_entropy(logits.transpose(1, 2), target.clamp(min=0), reduction="none")
    right = (logits.argmax(-1) == target) | ~valid
    return float(nll[valid].mean()), float(right.all(1).float().mean())


def marginal_answer_nll(train, test) -> float:
    """NLL of a model that knows the answer format but not the sum: each answer position's token
    frequencies counted on the train set. The level a LoRA run must beat to have learnt anything."""
    counts: Dict[tuple, Dict[int, int]] = {}
    for item in train.items:
        for pos, tok in enumerate(item["labels"].tolist()):
            if tok != -100:
                counts.setdefault(pos, {}).setdefault(tok, 0)
                counts[pos][tok] += 1
    total, n = 0.0, 0
    for item in test.items:
        for pos, tok in enumerate(item["labels"].tolist()):
            if tok != -100:
                c = counts.get(pos, {})
                total -= math.log((c.get(tok, 0) + 0.5) / (sum(c.values()) + 0.5 * VOCAB))
                n += 1
    return total / n


def train_lora(spec: Dict[str, Any], out_dir: str, seed: int) -> Dict[str, Any]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from example_train import CHAR_IDS, LORA_TARGETS, ArithmeticDataset, lora_plus_optimizer, tiny_llama_config

    torch.manual_seed(seed)
    model = get_peft_model(LlamaForCausalLM(tiny_llama_config()),
                           LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                      modules_to_save=["lm_head"]))
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    lora_start = {n: p.detach().clone() for n, p in lora.items()}
    lr, lora_lr = spec["lr"], spec.get("lora_lr", spec["lr"])
    optimizer = lora_plus_optimizer(model, lora_lr, lr)
    steps = spec["steps"]
    every = collect_every(steps)
    telemetry = TrainingTelemetry(TelemetryConfig(
        output_dir=out_dir, collect_every_n=every, holdout_size=64, batch_label_key="labels",
        holdout_token_ids=[CHAR_IDS[d] for d in "0123456789"]))
    holdout = ArithmeticDataset(64, seed=10_000 + seed)
    telemetry.set_holdout_data({k: torch.stack([x[k] for x in holdout.items]) for k in holdout.items[0]})
    train_set, test_set = ArithmeticDataset(2048, seed=seed), ArithmeticDataset(2000, seed=20_000 + seed)
    args = TrainingArguments(output_dir=os.path.join(out_dir, "trainer"), max_steps=steps,
                             per_device_train_batch_size=spec["batch"], learning_rate=lr,
                             lr_scheduler_type="linear", warmup_steps=steps // 20, logging_steps=every,
                             save_strategy="no", report_to=[], use_cpu=True, seed=seed, disable_tqdm=True,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=train_set, optimizers=(optimizer, None),
                      callbacks=[telemetry.hf_callback()])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    nll, exact = answer_nll(model, test_set)
    if spec.get("plant") == "lora_lr_zero":
        same = all(torch.equal(p.detach(), lora_start[n]) for n, p in lora.items())
        b_zero = all(not p.detach().any() for n, p in lora.items() if "lora_B" in n)
        verdict = Verdict(same and b_zero, f"LoRA unchanged={same}",
                          f"every LoRA A/B bit-identical to the start: {same}; every B exactly 0: {b_zero}; "
                          f"test answer NLL {nll:.3f}")
    else:
        base = marginal_answer_nll(train_set, test_set)
        moved = not all(torch.equal(p.detach(), lora_start[n]) for n, p in lora.items())
        ok = nll <= 0.5 * base and moved
        verdict = Verdict(ok, f"answer NLL {nll:.3f}",
                          f"test answer-token NLL {nll:.3f} over {len(test_set)} fresh sums vs {base:.3f} for "
                          f"a format-only model (needs <= half); exact answers {exact:.3f}; LoRA moved: {moved}",
                          {"answer_nll": nll, "format_only_nll": base, "exact": exact})
    return {"collect_every_n": every, "steps": steps, "verdict": verdict}
