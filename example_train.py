"""A worked example on synthetic data: a siamese pairwise "winner" model with telemetry.

Two images go through a shared backbone; a head reads both embeddings and predicts which one wins
(winner 0 or 1). The backbone trains at 1x and the head at 10x the learning rate, in two named param
groups. Scenarios plant the problems telemetry is for:

    python example_train.py                          # healthy, writes runs/healthy
    python example_train.py --scenario overfit       # tiny train set: train acc climbs, holdout ~50%
    python example_train.py --scenario frozen_backbone | imbalanced | exploding | zero_grad_first
    python analyze_telemetry.py runs/healthy

The LoRA run (a tiny Llama + peft LoRA on generated "a+b=c" text, through transformers.Trainer and
telemetry.hf_callback()), and the same through unsloth and TRL's SFTTrainer:

    python example_train.py --lora                   # CPU, under a minute, writes runs/lora
    python example_train.py --save-tiny-llama /tmp/tiny-llama && python example_train.py --unsloth /tmp/tiny-llama
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

import torch
from torch import nn

from telemetry import TelemetryConfig, TrainingTelemetry

SCENARIOS = {
    "healthy": dict(train_pairs=4096, epochs=3),
    # One batch an epoch, so batch_idx is always 1: collect at every batch to see anything.
    "overfit": dict(train_pairs=16, epochs=150, batch_size=16, collect_every_n=1),
    "frozen_backbone": dict(train_pairs=4096, epochs=3, backbone_lr=0.0),
    "imbalanced": dict(train_pairs=4096, epochs=3, winner_one_share=0.9),
    "exploding": dict(train_pairs=4096, epochs=3, backbone_lr=5.0, head_lr=50.0),
    "zero_grad_first": dict(train_pairs=4096, epochs=3),
}
IMAGE_DIM = 256


class SiameseWinner(nn.Module):
    def __init__(self, dim: int = IMAGE_DIM, hidden: int = 128, embed: int = 64):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(0.1),
                                      nn.Linear(hidden, embed), nn.ReLU())
        self.head = nn.Linear(2 * embed, 2)

    def forward(self, img1: torch.Tensor, img2: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.backbone(img1), self.backbone(img2)], dim=-1))


def make_pairs(n: int, generator: torch.Generator, direction: torch.Tensor, winner_one_share: float = 0.5):
    """Pairs of random "images"; the winner is the image with the larger hidden score direction . x."""
    img1 = torch.randn(n, IMAGE_DIM, generator=generator)
    img2 = torch.randn(n, IMAGE_DIM, generator=generator)
    winner = (img2 @ direction > img1 @ direction).long()
    if winner_one_share != 0.5:  # resample pairs until the label shares are as asked
        want_one = torch.rand(n, generator=generator) < winner_one_share
        swap = winner.bool() != want_one
        img1[swap], img2[swap] = img2[swap].clone(), img1[swap].clone()
        winner = want_one.long()
    return {"img1": img1, "img2": img2, "winner": winner}


def batches(data, batch_size: int, generator: torch.Generator):
    order = torch.randperm(len(data["winner"]), generator=generator)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        yield {k: v[idx] for k, v in data.items()}


def shown_epochs(epochs: int, lines: int = 5) -> set:
    """The epochs whose loss is printed: the first, the last and a few evenly between (150 lines tell no more)."""
    return {round(i * (epochs - 1) / (lines - 1)) for i in range(lines)} if epochs > lines else set(range(epochs))


def train(scenario: str = "healthy", out: str = None, config_path: str = "telemetry.yaml",
          collect_every_n: int = None, seed: int = 0, telemetry_on: bool = True, epochs: int = None,
          quiet: bool = False) -> nn.Module:
    spec = {"train_pairs": 4096, "epochs": 3, "batch_size": 32, "backbone_lr": 1e-3, "head_lr": 1e-2,
            "winner_one_share": 0.5, **SCENARIOS[scenario]}
    if epochs is not None:
        spec["epochs"] = epochs
    torch.manual_seed(seed)
    data_gen = torch.Generator().manual_seed(1234)
    direction = torch.randn(IMAGE_DIM, generator=data_gen)
    train_set = make_pairs(spec["train_pairs"], data_gen, direction, spec["winner_one_share"])
    val_set = make_pairs(512, data_gen, direction)

    model = SiameseWinner()
    optimizer = torch.optim.AdamW([
        {"params": model.backbone.parameters(), "lr": spec["backbone_lr"], "name": "backbone"},
        {"params": model.head.parameters(), "lr": spec["head_lr"], "name": "head"},
    ], weight_decay=0.01)

    telemetry = None
    if telemetry_on:
        overrides = {"output_dir": out or os.path.join("runs", scenario)}
        if collect_every_n or spec.get("collect_every_n"):
            overrides["collect_every_n"] = collect_every_n or spec["collect_every_n"]
        telemetry = TrainingTelemetry(TelemetryConfig.from_yaml(config_path, **overrides))
        telemetry.set_holdout_data(batches(val_set, 32, torch.Generator().manual_seed(0)))

    loss_fn = nn.CrossEntropyLoss()
    shuffle = torch.Generator().manual_seed(seed)
    started = time.time()
    for epoch in range(spec["epochs"]):
        for batch_idx, batch in enumerate(batches(train_set, spec["batch_size"], shuffle), 1):
            model.train()
            logits = model(batch["img1"], batch["img2"])
            loss = loss_fn(logits, batch["winner"])
            if scenario == "zero_grad_first":
                optimizer.zero_grad()  # the bug this scenario plants: gradients are gone before the hook
            loss.backward()
            optimizer.step()
            if scenario == "zero_grad_first":
                optimizer.zero_grad()
            if telemetry:
                train_acc = (logits.argmax(-1) == batch["winner"]).float().mean()
                telemetry.on_batch_end(model, optimizer, batch_idx, epoch, batch=batch, loss=loss,
                                       train_acc=train_acc)
            optimizer.zero_grad()
        if not quiet and epoch in shown_epochs(spec["epochs"]):
            print(f"epoch {epoch + 1}/{spec['epochs']}: last loss {loss.item():.3g}", file=sys.stderr)
    if telemetry:
        telemetry.close()
        if not quiet:
            print(f"trained {scenario!r} in {time.time() - started:.1f}s; run directory: {telemetry.output_dir}")
            print(f"analyze it with: python analyze_telemetry.py {telemetry.output_dir}")
    return model


# ---- LoRA: a tiny Llama with peft LoRA through transformers.Trainer (CPU), or unsloth + TRL (GPU) -------
# Text is single-digit "a+b=c" arithmetic; the prompt "a+b=" is masked out of the labels (-100), as in SFT,
# and the holdout logs the logits of the ten digits where the answer starts (holdout_token_ids).

ARITH_VOCAB = ["<pad>", "<s>", "</s>", "<unk>"] + list("0123456789+=\n")
CHAR_IDS = {t: i for i, t in enumerate(ARITH_VOCAB)}
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
ARITH_LEN = 10  # <s> + "9+9=18\n" + </s> fits, padded to a fixed length
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def arithmetic_pairs(n: int, generator: torch.Generator, top: int = 10):
    """(prompt, answer) strings such as ("12+7=", "19\\n")."""
    ab = torch.randint(0, top, (n, 2), generator=generator).tolist()
    return [(f"{a}+{b}=", f"{a + b}\n") for a, b in ab]


def encode_pair(prompt: str, answer: str, length: int = ARITH_LEN):
    """Char-level ids, right-padded; labels are -100 on the prompt and on padding (only the answer trains)."""
    ids = [BOS_ID] + [CHAR_IDS[c] for c in prompt + answer] + [EOS_ID]
    supervised = len(prompt) + 1  # <s> and the prompt
    ids, pad = ids[:length], length - min(len(ids), length)
    labels = [-100] * supervised + ids[supervised:]
    return {"input_ids": torch.tensor(ids + [PAD_ID] * pad), "labels": torch.tensor(labels + [-100] * pad),
            "attention_mask": torch.tensor([1] * len(ids) + [0] * pad)}


class ArithmeticDataset(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        self.items = [encode_pair(p, a) for p, a in arithmetic_pairs(n, torch.Generator().manual_seed(seed))]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    spec = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=len(ARITH_VOCAB), max_position_embeddings=64,
                pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    return LlamaConfig(**{**spec, **overrides})


def train_lora(out: str = os.path.join("runs", "lora"), max_steps: int = 300, collect_every_n: int = 10,
               seed: int = 0, quiet: bool = False):
    """Tiny LlamaForCausalLM (built from a config, no download) + peft LoRA, trained by transformers.Trainer
    on the CPU with telemetry.hf_callback(). Returns the trained peft model."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small runs faster on one thread than on a contended pool
    try:
        return _train_lora(out, max_steps, collect_every_n, seed, quiet, get_peft_model, LoraConfig,
                           LlamaForCausalLM, Trainer, TrainingArguments)
    finally:
        torch.set_num_threads(threads)


def lora_plus_optimizer(model: nn.Module, lora_lr: float, head_lr: float) -> torch.optim.Optimizer:
    """AdamW over the trainable tensors in named groups lora_A, lora_B (LoRA+ style: B learns 4x faster than
    A) and lm_head; named, so every group's lr shows in the records."""
    groups: dict = {"lora_A": [], "lora_B": [], "lm_head": []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups["lora_A" if "lora_A" in name else "lora_B" if "lora_B" in name else "lm_head"].append(p)
    return torch.optim.AdamW([{"params": groups["lora_A"], "lr": lora_lr, "name": "lora_A"},
                              {"params": groups["lora_B"], "lr": 4 * lora_lr, "name": "lora_B"},
                              {"params": groups["lm_head"], "lr": head_lr, "name": "lm_head"}], weight_decay=0.0)


def _train_lora(out, max_steps, collect_every_n, seed, quiet, get_peft_model, LoraConfig, LlamaForCausalLM,
                Trainer, TrainingArguments):
    # A Trainer run starts again at step 1: start the run directory afresh too, rather than append to it.
    for name in ("telemetry.jsonl", "run.json", "last_checkpoint.safetensors", "initial_weights.safetensors"):
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    torch.manual_seed(seed)
    # The random base's lm_head is trained too (modules_to_save): with a frozen random head and the final
    # RMSNorm the logits could never grow confident, whatever the adapters learn.
    model = get_peft_model(LlamaForCausalLM(tiny_llama_config()),
                           LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                      modules_to_save=["lm_head"]))
    lr = 5e-3
    optimizer = lora_plus_optimizer(model, lr, lr)
    telemetry = TrainingTelemetry(TelemetryConfig(
        output_dir=out, collect_every_n=collect_every_n, holdout_size=64, batch_label_key="labels",
        holdout_token_ids=[CHAR_IDS[d] for d in "0123456789"]))
    holdout = ArithmeticDataset(64, seed=10_000 + seed)
    telemetry.set_holdout_data({k: torch.stack([x[k] for x in holdout.items]) for k in holdout.items[0]})
    args = TrainingArguments(output_dir=os.path.join(out, "trainer"), max_steps=max_steps,
                             per_device_train_batch_size=32, learning_rate=lr, lr_scheduler_type="linear",
                             warmup_steps=max_steps // 20, logging_steps=collect_every_n, save_strategy="no",
                             report_to=[], use_cpu=True, seed=seed, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=ArithmeticDataset(4096, seed=seed),
                      optimizers=(optimizer, None), callbacks=[telemetry.hf_callback()])
    if quiet:
        from transformers.trainer_callback import PrinterCallback
        trainer.remove_callback(PrinterCallback)
    started = time.time()
    trainer.train()
    if not quiet:
        print(f"trained LoRA in {time.time() - started:.1f}s; run directory: {out}")
        print(f"analyze it with: python analyze_telemetry.py {out}")
    return model


def save_tiny_llama(path: str, seed: int = 0) -> str:
    """Save a tiny Llama with a char-level tokenizer (made here, no download) for --unsloth to load."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    # head_dim 64: the size unsloth's fused kernels are written for.
    LlamaForCausalLM(tiny_llama_config(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                       num_key_value_heads=2)).save_pretrained(path)
    tokenizer = Tokenizer(models.BPE(vocab=CHAR_IDS, merges=[], unk_token="<unk>"))  # no merges: chars
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>", model_max_length=64).save_pretrained(path)
    return path


def unsloth_model(model_dir: str, seed: int = 0, load_in_4bit: bool = False, checkpointing=False):
    """unsloth's FastLanguageModel over a saved Llama, with LoRA r=8 on every projection: (model, tokenizer).
    unsloth must be imported before transformers and peft, which it patches as they are imported.
    checkpointing is unsloth's use_gradient_checkpointing (False, True or "unsloth")."""
    import unsloth  # noqa: F401
    from unsloth import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(model_name=model_dir, max_seq_length=64, dtype=None,
                                                         load_in_4bit=load_in_4bit)
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=16, lora_dropout=0.0, bias="none",
                                             target_modules=LORA_TARGETS, use_gradient_checkpointing=checkpointing,
                                             random_state=seed)
    return model, tokenizer


def sft_holdout(tokenizer, seed: int = 0, padding_side: str = "right") -> dict:
    """32 "a+b=c" lines the run never trains on, as one batch padded on `padding_side`; labels are the ids, -100
    on padding. The side is set here, not taken from the tokenizer, whose state a trainer may change."""
    held = tokenizer([p + a for p, a in arithmetic_pairs(32, torch.Generator().manual_seed(10_000 + seed))],
                     return_tensors="pt", padding=True, padding_side=padding_side)
    return {"input_ids": held["input_ids"], "attention_mask": held["attention_mask"],
            "labels": held["input_ids"].masked_fill(held["attention_mask"] == 0, -100)}


def sft_trainer(model, tokenizer, out: str, max_steps: int = 60, collect_every_n: int = 5, seed: int = 0,
                learning_rate: float = 2e-3, accumulation: int = 1, holdout: Optional[dict] = None):
    """TRL's SFTTrainer over "a+b=c" text with telemetry.hf_callback(), the Trainer logging every optimizer step
    (of `accumulation` micro-batches of 16); the holdout is sft_holdout's unless given."""
    import inspect

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    texts = [p + a for p, a in arithmetic_pairs(2048, torch.Generator().manual_seed(seed))]
    telemetry = TrainingTelemetry(TelemetryConfig(output_dir=out, collect_every_n=collect_every_n,
                                                  holdout_size=32, batch_label_key="labels"))
    telemetry.set_holdout_data(sft_holdout(tokenizer, seed) if holdout is None else holdout)
    fields = inspect.signature(SFTConfig).parameters  # TRL renamed max_seq_length to max_length
    length_key = "max_length" if "max_length" in fields else "max_seq_length"
    config = SFTConfig(output_dir=os.path.join(out, "trainer"), max_steps=max_steps, learning_rate=learning_rate,
                       per_device_train_batch_size=16, gradient_accumulation_steps=accumulation, logging_steps=1,
                       save_strategy="no", report_to="none", seed=seed, dataset_text_field="text", disable_tqdm=True,
                       use_cpu=not torch.cuda.is_available(), **{length_key: 64})
    takes = inspect.signature(SFTTrainer.__init__).parameters
    tokenizer_arg = {"processing_class" if "processing_class" in takes else "tokenizer": tokenizer}
    return SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"text": texts}),
                      callbacks=[telemetry.hf_callback()], **tokenizer_arg)


def train_unsloth(model_dir: str, out: str = os.path.join("runs", "unsloth"), max_steps: int = 60,
                  collect_every_n: int = 5, seed: int = 0) -> int:
    """The LoRA run through unsloth.FastLanguageModel and TRL's SFTTrainer: on a CUDA GPU, or on the CPU where
    unsloth's version has a CPU fallback. Returns an exit code: 2 when unsloth, trl or datasets cannot be imported
    here (not installed, or an unsloth that needs a GPU on a machine without one)."""
    if "transformers" in sys.modules or "peft" in sys.modules:
        print("note: transformers/peft were imported before unsloth; unsloth may not patch them",
              file=sys.stderr)
    try:
        import unsloth  # noqa: F401  first: it patches transformers, peft and trl as they are imported
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except Exception as exc:  # ImportError, or unsloth's own "cannot find any torch accelerator"
        print(f"--unsloth: cannot import unsloth/trl/datasets ({type(exc).__name__}: {exc}); pip install unsloth "
              "(with torch pinned on the same command line). Use --lora for the same run through peft alone.",
              file=sys.stderr)
        return 2
    model, tokenizer = unsloth_model(model_dir, seed)
    sft_trainer(model, tokenizer, out, max_steps, collect_every_n, seed).train()
    print(f"trained with unsloth; run directory: {out}\nanalyze it with: python analyze_telemetry.py {out}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="healthy")
    parser.add_argument("--out", help="run directory (default runs/<scenario>)")
    parser.add_argument("--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                         "telemetry.yaml"))
    parser.add_argument("--collect-every-n", type=int, help="override collect_every_n from the config")
    parser.add_argument("--epochs", type=int, help="override the scenario's number of epochs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora", action="store_true",
                        help="tiny Llama + peft LoRA through transformers.Trainer on the CPU (runs/lora)")
    parser.add_argument("--unsloth", metavar="MODEL_DIR",
                        help="the LoRA run through unsloth and TRL's SFTTrainer (runs/unsloth)")
    parser.add_argument("--save-tiny-llama", metavar="DIR",
                        help="save a tiny Llama and tokenizer to DIR for --unsloth, then exit")
    parser.add_argument("--max-steps", type=int, help="optimizer steps of the --lora/--unsloth run")
    args = parser.parse_args(argv)
    steps = {"max_steps": args.max_steps} if args.max_steps else {}
    every = {"collect_every_n": args.collect_every_n} if args.collect_every_n else {}
    if args.unsloth:  # before anything imports transformers or peft: unsloth must come first
        return train_unsloth(args.unsloth, args.out or os.path.join("runs", "unsloth"), seed=args.seed,
                             **steps, **every)
    if args.save_tiny_llama:
        print(f"saved a tiny Llama to {save_tiny_llama(args.save_tiny_llama, args.seed)}")
        return 0
    if args.lora:
        train_lora(args.out or os.path.join("runs", "lora"), seed=args.seed, **steps, **every)
        return 0
    train(args.scenario, args.out, args.config, args.collect_every_n, args.seed, epochs=args.epochs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
