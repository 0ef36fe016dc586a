"""Drop-in training telemetry for PyTorch: one file, one class, one hook.

Copy this file into your project, then:

    from telemetry import TelemetryConfig, TrainingTelemetry
    telemetry = TrainingTelemetry(TelemetryConfig.from_yaml("telemetry.yaml", output_dir="runs/exp1"))
    ...
    optimizer.step()
    telemetry.on_batch_end(model, optimizer, batch_idx, epoch, batch=batch, loss=loss)   # before zero_grad
    optimizer.zero_grad()

Every `collect_every_n` batches one strict-JSON line is appended to `output_dir/telemetry.jsonl`; read it
with `python analyze_telemetry.py output_dir`. The only hard dependency is torch: yaml, transformers, peft,
unsloth, wandb and lightning are imported lazily, where they are used.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import difflib
import fnmatch
import json
import math
import os
import random
import sys
import time
import typing
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

SCHEMA_VERSION = 1
RECORDS_FILE = "telemetry.jsonl"
RUN_FILE = "run.json"
REFERENCE_FILE = "last_checkpoint.safetensors"
IGNORE_INDEX = -100  # label value that HF losses skip (padding, prompt tokens)
# Dict keys tried, in order, when the config names no label key; "winner" is the seed's pairwise label.
LABEL_KEYS = ("labels", "label", "winner", "target", "targets", "y")
MAX_LOGGED_CLASSES = 64  # above this, holdout logits are summarised instead of stored per class
MAX_BALANCE_VALUES = 32  # above this many distinct labels, batch balance is summarised


# =====================================================================================================
# Config
# =====================================================================================================


@dataclass
class TelemetryConfig:
    """What to collect and how often. Every field can come from YAML (see telemetry.yaml)."""

    enabled: bool = True  # off: on_batch_end returns at once and nothing is written
    collect_every_n: int = 200  # collect when batch_idx % collect_every_n == 0
    output_dir: Optional[str] = None  # where telemetry.jsonl, run.json and the weight reference go

    track_gradients: bool = True  # gradient L2 norm, overall and per group
    track_weight_delta: bool = True  # L2 distance of trainable weights since the previous collection
    track_learning_rates: bool = True  # the current lr of every group
    track_holdout_logits: bool = True  # predictions on a fixed holdout set (see set_holdout_data)
    track_batch_stats: bool = True  # label balance of the batch passed to on_batch_end

    holdout_size: int = 50  # number of holdout *examples* (not batches) kept from set_holdout_data
    # Group name -> parameter-name patterns. A pattern is a glob ("backbone.*") or a dotted segment run
    # ("head", "lora_A") matched anywhere in the name. Unset: the optimizer's param groups, by "name".
    groups: Optional[Dict[str, List[str]]] = None
    batch_label_key: Optional[str] = None  # label key in dict batches; unset: the first of LABEL_KEYS found
    strict: bool = False  # raise metric errors instead of recording them (tests use this)

    def __post_init__(self):
        if isinstance(self.output_dir, os.PathLike):
            self.output_dir = os.fspath(self.output_dir)
        if isinstance(self.groups, dict):
            self.groups = {k: [v] if isinstance(v, str) else v for k, v in self.groups.items()}
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), hints[f.name])
        if self.collect_every_n < 1:
            raise ValueError(f"collect_every_n: must be >= 1, got {self.collect_every_n}")
        if self.holdout_size < 0:
            raise ValueError(f"holdout_size: must be >= 0, got {self.holdout_size}")
        if self.enabled and self.output_dir is not None:
            _check_writable_dir("output_dir", self.output_dir)

    @classmethod
    def from_dict(cls, config_dict: Dict[str, Any]) -> "TelemetryConfig":
        """Build from a dict (e.g. a YAML section). Unknown keys are an error, never silently dropped."""
        if not isinstance(config_dict, dict):
            raise ValueError(f"telemetry config: expected a mapping, got {type(config_dict).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in config_dict:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"; did you mean {close[0]}?" if close else f"; valid keys: {', '.join(known)}"
                raise ValueError(f"unknown telemetry config key {key!r}{hint}")
        return cls(**config_dict)

    @classmethod
    def from_yaml(cls, path: str, **overrides: Any) -> "TelemetryConfig":
        """Read a YAML file (flat, or under a top-level `telemetry:` key); keyword arguments override it."""
        import yaml  # lazy: the module must import with torch alone

        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
        if isinstance(data, dict) and isinstance(data.get("telemetry"), dict) and len(data) == 1:
            data = data["telemetry"]
        return cls.from_dict({**data, **overrides})


def _check_type(name: str, value: Any, hint: Any) -> None:
    if not _matches_type(value, hint):
        shown = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
        raise ValueError(f"{name}: expected {shown}, got {value!r} ({type(value).__name__})")


def _matches_type(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return any(_matches_type(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:  # bool is an int subclass, but `collect_every_n: true` is a mistake
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (dict, Dict):
        return isinstance(value, dict) and all(
            _matches_type(k, args[0]) and _matches_type(v, args[1]) for k, v in value.items())
    if origin in (list, List):
        return isinstance(value, (list, tuple)) and all(_matches_type(v, args[0]) for v in value)
    if hint is Any:
        return True
    return isinstance(value, hint)


def _check_writable_dir(name: str, path: str) -> None:
    # Walk up to the nearest existing ancestor: the directory itself is only created when telemetry starts.
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ValueError(f"{name}: {path!r} cannot be created: {probe!r} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{name}: {path!r} is not writable ({probe!r} denies write access)")


# =====================================================================================================
# Metrics: pure functions of tensors; no I/O, no host syncs (the class does one transfer per record)
# =====================================================================================================


def per_tensor_sq_norms(tensors: List[torch.Tensor], device: Optional[torch.device] = None) -> torch.Tensor:
    """Squared L2 norm of each tensor, as one float32 vector [len(tensors)] on `device`.

    ||t||^2 for every t, computed with torch._foreach_norm per (device, dtype) bucket (the clip_grad_norm_
    fast path) in float32, so fp16/bf16 norms neither overflow nor lose precision. No host sync.
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.float32, device=device or "cpu")
    device = device or tensors[0].device
    buckets: Dict[Any, List[int]] = {}
    for i, t in enumerate(tensors):
        buckets.setdefault((t.device, t.dtype), []).append(i)
    out = torch.empty(len(tensors), dtype=torch.float32, device=device)
    for (dev, _), idx in buckets.items():
        norms = torch._foreach_norm([tensors[i] for i in idx], 2, dtype=torch.float32)
        sq = torch.stack(norms).square().to(device)
        out[torch.tensor(idx, device=device)] = sq
    return out


def group_norms(per_tensor_sq: torch.Tensor, membership: torch.Tensor) -> torch.Tensor:
    """Per-group L2 norms from per-tensor squared norms: sqrt(M @ sq), M[g, i] = 1 if tensor i is in g.

    Groups of one partition are disjoint, so their squared norms add up to the overall squared norm.
    """
    return (membership.to(per_tensor_sq.device) @ per_tensor_sq).sqrt()


def classification_holdout(logits: torch.Tensor, labels: torch.Tensor) -> Dict[str, Any]:
    """Accuracy, mean loss and per-example predictions for [N, C] (or [N] / [N, 1] binary) logits.

    Binary single-logit outputs use sigmoid/BCE with prediction = logit > 0; otherwise softmax/CE with
    prediction = argmax. Returns tensors; nothing is moved to the host here.
    """
    logits = logits.detach().float()
    labels = labels.detach().to(logits.device).reshape(-1)
    if logits.dim() == 1 or logits.shape[-1] == 1:
        logits = logits.reshape(-1)
        predictions = (logits > 0).long()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.float())
        num_classes = 2
    else:
        predictions = logits.argmax(-1)
        loss = torch.nn.functional.cross_entropy(logits, labels.long())
        num_classes = logits.shape[-1]
    out = {"kind": "classification"}
    if num_classes <= MAX_LOGGED_CLASSES:
        out["logits"] = logits
    out.update(labels=labels.long(), predictions=predictions,
               accuracy=(predictions == labels.long()).float().mean(), loss=loss, num_classes=num_classes)
    return out


def language_model_holdout(logits: torch.Tensor, labels: torch.Tensor) -> Dict[str, Any]:
    """Per-example mean token NLL and top-1 token accuracy for causal-LM logits [N, T, V].

    Labels are shifted by one as HF causal LMs do (position t predicts token t+1) and positions labelled
    IGNORE_INDEX are skipped. The full [N, T, V] logits are never kept.
    """
    logits = logits.detach()[:, :-1, :].float()
    target = labels.detach().to(logits.device)[:, 1:].long()
    valid = target != IGNORE_INDEX
    nll = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), target.clamp(min=0), reduction="none") * valid
    correct = (logits.argmax(-1) == target) & valid
    tokens = valid.sum(1)
    per_tokens = tokens.clamp(min=1).float()
    return {"kind": "lm", "nll": nll.sum(1) / per_tokens, "token_accuracy": correct.sum(1) / per_tokens,
            "loss": nll.sum() / tokens.sum().clamp(min=1), "accuracy": correct.sum() / tokens.sum().clamp(min=1),
            "tokens": tokens}


def label_balance(labels: torch.Tensor, key: str) -> Dict[str, Any]:
    """Count and percentage of each label value in a batch, under the seed's "<key>_<value>_pct" keys."""
    values = labels.detach().reshape(-1).cpu()
    stats: Dict[str, Any] = {"batch_size": int(labels.shape[0]) if labels.dim() else 1, "label_key": key}
    if values.is_floating_point() and not torch.equal(values, values.round()):
        return stats  # a regression target has no classes to balance
    uniq, counts = torch.unique(values.long(), return_counts=True)
    total = max(int(values.numel()), 1)
    if len(uniq) > MAX_BALANCE_VALUES:
        stats.update(distinct_labels=len(uniq), max_label_pct=100.0 * int(counts.max()) / total)
        return stats
    stats["counts"] = {str(v): c for v, c in zip(uniq.tolist(), counts.tolist())}
    for v, c in zip(uniq.tolist(), counts.tolist()):
        stats[f"{key}_{v}_pct"] = 100.0 * c / total
    return stats


def token_balance(batch: Dict[str, Any]) -> Dict[str, Any]:
    """Tokens, share of supervised label positions and padding share of a language-model batch."""
    ids = batch["input_ids"]
    stats: Dict[str, Any] = {"batch_size": int(ids.shape[0]), "tokens": int(ids.numel())}
    if isinstance(batch.get("labels"), torch.Tensor):
        stats["label_share"] = (batch["labels"] != IGNORE_INDEX).float().mean()
    if isinstance(batch.get("attention_mask"), torch.Tensor):
        stats["padding_share"] = (batch["attention_mask"] == 0).float().mean()
    return stats


def param_matches(name: str, pattern: str) -> bool:
    """A glob ("backbone.*") matches the whole name; a plain pattern matches a run of dotted segments."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return f".{pattern}." in f".{name}."


def find_label_key(batch: Dict[str, Any], configured: Optional[str]) -> Optional[str]:
    if configured is not None:
        return configured if configured in batch else None
    return next((k for k in LABEL_KEYS if isinstance(batch.get(k), torch.Tensor)), None)


def output_logits(outputs: Any) -> torch.Tensor:
    """Logits from a model output: a tensor, an object with .logits (HF), or the first tuple element."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if getattr(outputs, "logits", None) is not None:
        return outputs.logits
    if isinstance(outputs, dict) and "logits" in outputs:
        return outputs["logits"]
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    raise TypeError(f"cannot find logits in model output of type {type(outputs).__name__}; "
                    "pass forward= to set_holdout_data")


def batch_size_of(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else []
    for item in items:
        if isinstance(item, torch.Tensor) and item.dim():
            return int(item.shape[0])
    raise TypeError(f"cannot tell the batch size of a {type(batch).__name__}")


def slice_batch(batch: Any, n: int) -> Any:
    """The first n examples of a batch (tensors along dim 0; other leaves unchanged)."""
    if isinstance(batch, torch.Tensor):
        return batch[:n] if batch.dim() else batch
    if isinstance(batch, dict):
        return {k: slice_batch(v, n) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(slice_batch(v, n) for v in batch)
    return batch


def move_to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(v, device) for v in batch)
    return batch


def to_host(record: Dict[str, Any]) -> Dict[str, Any]:
    """Replace every tensor in a nested record by Python numbers, with one device-to-host copy per device.

    All tensor leaves on a device are flattened into one float64 vector, copied once, and split back, so a
    record costs one sync however many norms it holds. Integer and bool tensors come back as int/bool.
    """
    leaves: List[torch.Tensor] = []

    def collect(node):
        if isinstance(node, torch.Tensor):
            leaves.append(node)
        elif isinstance(node, dict):
            for v in node.values():
                collect(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                collect(v)

    collect(record)
    if not leaves:
        return record
    by_device: Dict[torch.device, List[int]] = {}
    for i, t in enumerate(leaves):
        by_device.setdefault(t.device, []).append(i)
    host: Dict[int, Any] = {}
    for dev, idx in by_device.items():
        wide = torch.float32 if dev.type == "mps" else torch.float64  # mps has no float64
        flat = torch.cat([leaves[i].detach().reshape(-1).to(wide) for i in idx]).cpu().tolist()
        pos = 0
        for i in idx:
            t = leaves[i]
            n = t.numel()
            chunk = flat[pos:pos + n]
            pos += n
            if not t.is_floating_point():
                chunk = [bool(v) for v in chunk] if t.dtype == torch.bool else [int(v) for v in chunk]
            elif t.dtype != torch.float64:  # 9 significant digits round-trip float32 exactly, in half the text
                chunk = [float(f"{v:.9g}") for v in chunk]
            host[id(t)] = chunk[0] if t.dim() == 0 else _reshape(chunk, list(t.shape))

    def rebuild(node):
        if isinstance(node, torch.Tensor):
            return host[id(node)]
        if isinstance(node, dict):
            return {k: rebuild(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [rebuild(v) for v in node]
        return node

    return rebuild(record)


def _reshape(flat: List[Any], shape: List[int]) -> Any:
    if len(shape) <= 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_reshape(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def replace_nonfinite(record: Any, path: str = "", found: Optional[List[str]] = None):
    """Return (record with NaN/Inf floats as None, dotted paths of those values) so JSON stays strict."""
    found = [] if found is None else found
    if isinstance(record, float) and not math.isfinite(record):
        found.append(path)
        return None, found
    if isinstance(record, dict):
        return {k: replace_nonfinite(v, f"{path}.{k}" if path else str(k), found)[0]
                for k, v in record.items()}, found
    if isinstance(record, list):
        if any(isinstance(v, float) and not math.isfinite(v) for v in record) or any(
                isinstance(v, (list, dict)) for v in record):
            out = [replace_nonfinite(v, f"{path}[{i}]", found)[0] for i, v in enumerate(record)]
            # Per-element paths in a long list would swamp the record: keep only the list's own path.
            if sum(p.startswith(path + "[") for p in found) > 3:
                kept = [p for p in found if not p.startswith(path + "[")]
                found[:] = kept + [path]
            return out, found
    return record, found


# =====================================================================================================
# Weight reference on disk: the safetensors layout, written and read one tensor at a time, never pickled
# =====================================================================================================

_DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                torch.uint8: "U8", torch.bool: "BOOL"}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


def write_tensor_file(path: str, named: List[tuple]) -> None:
    """Write [(name, tensor)] as a safetensors file, streaming: peak extra memory is one tensor (GPU) or 0.

    Written to a temp file and moved over `path` with os.replace, so a crash mid-write leaves the previous
    file intact. No fsync: this is a cache that a crash may lose, and fsync per collection would dominate.
    """
    header, offset = {}, 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_CODES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data section to 8 bytes
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            for _, t in named:
                t = t.detach()
                t = (t if t.device.type == "cpu" else t.to("cpu")).contiguous()
                if t.numel():
                    f.write(memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(
                        t.data_ptr())))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def read_tensor_header(path: str) -> tuple:
    """(header dict name -> {dtype, shape, data_offsets}, byte offset of the data section)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def stream_tensor_file(path: str, names: List[str]):
    """Yield each named tensor of a safetensors file, read into one reused buffer (valid until the next).

    Reading through a buffer instead of mmap keeps the reference out of the process's RSS.
    """
    header, base = read_tensor_header(path)
    sizes = [header[n]["data_offsets"][1] - header[n]["data_offsets"][0] for n in names]
    buf = bytearray(max(sizes, default=0) or 1)
    view = memoryview(buf)
    with open(path, "rb") as f:
        for name, size in zip(names, sizes):
            meta = header[name]
            dtype = _CODE_DTYPES[meta["dtype"]]
            if size == 0:
                yield torch.empty(meta["shape"], dtype=dtype)
                continue
            f.seek(base + meta["data_offsets"][0])
            f.readinto(view[:size])
            numel = size // torch.empty(0, dtype=dtype).element_size()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # frombuffer warns about sharing a writable buffer
                yield torch.frombuffer(buf, dtype=dtype, count=numel).reshape(meta["shape"])


def reference_matches(path: str, named: List[tuple]) -> bool:
    """True when the file holds exactly these names with these shapes and dtypes."""
    try:
        header, _ = read_tensor_header(path)
    except (OSError, ValueError):
        return False
    return len(header) == len(named) and all(
        n in header and header[n]["shape"] == list(t.shape) and header[n]["dtype"] == _DTYPE_CODES.get(t.dtype)
        for n, t in named)


def streamed_sq_distances(named: List[tuple], reference_path: str) -> torch.Tensor:
    """||w - w_ref||^2 per tensor against a reference file, in float32, one tensor in memory at a time."""
    out = []
    names = [n for n, _ in named]
    for (_, w), ref in zip(named, stream_tensor_file(reference_path, names)):
        w = w.detach()
        diff = w.float() - ref.to(w.device).float()
        out.append(torch.linalg.vector_norm(diff).square())
    return torch.stack(out) if out else torch.zeros(0)


# =====================================================================================================
# TrainingTelemetry: decides when to collect, calls the metrics, and does all the I/O
# =====================================================================================================


@dataclass
class _Layout:
    """Trainable parameters in a fixed order and the groups they belong to (cached per model/optimizer)."""
    key: tuple
    names: List[str]
    params: List[torch.nn.Parameter]
    group_names: List[str]
    membership: torch.Tensor  # [groups, params] 0/1 float32; rows [:first_partition] partition "overall"
    first_partition: int
    lr_names: List[str]
    group_lrs: List[Callable[[], Any]]  # reads a group's current lr (0.0 for parameters no optimizer holds)


class TrainingTelemetry:
    """Collects gradient norms, weight deltas, learning rates, holdout predictions and batch balance.

    Call `on_batch_end` after `optimizer.step()` and before `zero_grad()`. Errors inside a metric are
    recorded in the record's `errors` and warned about once; training never sees them unless `strict`.
    """

    def __init__(self, config: Optional[TelemetryConfig] = None, **overrides: Any):
        if config is None or overrides:
            base = dataclasses.asdict(config) if config is not None else {}
            config = TelemetryConfig.from_dict({**base, **overrides})
        self.config = config
        self.step = 0
        self._enabled = config.enabled
        self._every = config.collect_every_n
        self._warned: set = set()
        self._holdout: List[Any] = []
        self._holdout_on: Dict[str, List[Any]] = {}
        self._holdout_forward: Optional[Callable] = None
        self._holdout_labels: Optional[Callable] = None
        self._layout: Optional[_Layout] = None
        self._records = None
        self._silent_warn_step = 10 * self._every  # warn if nothing was collected by then
        if not self._enabled:
            return
        if config.output_dir is None:
            raise ValueError("output_dir: must be set (in the YAML, or TelemetryConfig(output_dir=...))")
        self.output_dir = config.output_dir
        os.makedirs(self.output_dir, exist_ok=True)
        self.metrics_file = os.path.join(self.output_dir, RECORDS_FILE)
        self.checkpoint_file = os.path.join(self.output_dir, REFERENCE_FILE)
        self.run_file = os.path.join(self.output_dir, RUN_FILE)
        self.step = self._last_logged_step()
        self._run_info = self._load_run_info()
        self._run_info["starts"].append(datetime.datetime.now().isoformat())
        self._run_info.update(schema=SCHEMA_VERSION, torch_version=torch.__version__,
                              config=dataclasses.asdict(config))
        self._write_run_info()

    # ---- public API --------------------------------------------------------------------------------

    def set_holdout_data(self, batches: Any, forward: Optional[Callable] = None,
                         labels: Optional[Callable] = None) -> None:
        """Keep the first `holdout_size` examples of `batches` (an iterable of batches, or one batch).

        A (inputs..., labels) tuple runs model(*inputs); a dict runs model(**batch without the label key).
        `forward(model, batch) -> outputs` and `labels(batch) -> tensor` override this.
        """
        if isinstance(batches, dict) or (isinstance(batches, (tuple, list)) and batches
                                         and isinstance(batches[0], torch.Tensor)):
            batches = [batches]
        kept, have = [], 0
        for batch in batches:
            if have >= self.config.holdout_size:
                break
            n = batch_size_of(batch)
            take = min(n, self.config.holdout_size - have)
            kept.append(batch if take == n else slice_batch(batch, take))
            have += take
        self._holdout, self._holdout_on = kept, {}
        self._holdout_forward, self._holdout_labels = forward, labels
        if self._enabled:
            self._run_info["holdout"] = {"examples": have}
            self._write_run_info()

    def on_batch_end(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                     batch_idx: int, epoch: int, device: Any = None, batch: Any = None, loss: Any = None,
                     **scalars: Any) -> Optional[Dict[str, Any]]:
        """The hook: call after optimizer.step(), before zero_grad(). Returns the record when it collects."""
        self.step += 1
        if not self._enabled or batch_idx % self._every:
            if self.step == self._silent_warn_step:
                self._warn_silent()
            return None
        try:
            return self._collect(model, optimizer, batch_idx, epoch, device, batch, loss, scalars)
        except Exception as exc:  # the training loop must never see telemetry fail
            if self.config.strict:
                raise
            self._warn_once("collect", f"telemetry: collection failed and was skipped: {exc!r}")
            return None

    def _warn_silent(self) -> None:
        self._warn_once("silent", f"telemetry: nothing collected in {self.step} calls: batch_idx was never a "
                                  f"multiple of collect_every_n={self._every}. Epochs shorter than that restart "
                                  "batch_idx before it gets there; lower collect_every_n.")

    def close(self) -> None:
        if self._records is not None:
            self._records.close()
            self._records = None

    def __enter__(self) -> "TrainingTelemetry":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- one collection ----------------------------------------------------------------------------

    def _collect(self, model, optimizer, batch_idx, epoch, device, batch, loss, scalars):
        started = time.perf_counter()
        cfg = self.config
        record: Dict[str, Any] = {"schema": SCHEMA_VERSION, "step": self.step, "batch_idx": batch_idx,
                                  "epoch": epoch, "timestamp": datetime.datetime.now().isoformat()}
        if loss is not None:
            record["loss"] = loss.detach() if isinstance(loss, torch.Tensor) else loss
        for key, value in scalars.items():
            if key in record or key in _SECTION_KEYS:
                raise ValueError(f"on_batch_end: extra scalar {key!r} clashes with a record key")
            record[key] = value.detach() if isinstance(value, torch.Tensor) else value
        errors: Dict[str, str] = {}
        layout = self._run_section("layout", errors, self._layout_for, model, optimizer)
        if layout is not None:
            if cfg.track_gradients:
                self._add(record, errors, "gradient_norm", self._gradient_norms, layout)
            if cfg.track_weight_delta:
                self._add(record, errors, "weight_delta", self._weight_delta, layout)
            if cfg.track_learning_rates and optimizer is not None:
                self._add(record, errors, "learning_rates", self._learning_rates, layout)
        if cfg.track_holdout_logits and self._holdout:
            self._add(record, errors, "holdout_logits", self._evaluate_holdout, model, device)
        if cfg.track_batch_stats and batch is not None:
            self._add(record, errors, "batch_stats", self._batch_stats, batch)
        record = to_host(record)
        self._check_gradients(record)
        record["telemetry_ms"] = (time.perf_counter() - started) * 1e3
        self._silent_warn_step = -1
        record, nonfinite = replace_nonfinite(record)
        if nonfinite:
            record["nonfinite"] = nonfinite
        if errors:
            record["errors"] = errors
        self._append(record)
        return record

    def _add(self, record, errors, section, fn, *args):
        value = self._run_section(section, errors, fn, *args)
        if value is not None:
            record[section] = value

    def _run_section(self, section, errors, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:
            if self.config.strict:
                raise
            errors[section] = f"{type(exc).__name__}: {exc}"
            self._warn_once(f"error:{section}", f"telemetry: {section} failed ({errors[section]}); it is "
                                                "recorded under 'errors' and training goes on")
            return None

    # ---- sections ----------------------------------------------------------------------------------

    def _gradient_norms(self, layout: _Layout) -> Dict[str, Any]:
        grads = [p.grad for p in layout.params]
        present = [g for g in grads if g is not None]
        if not present:
            return {"overall": None, **{g: None for g in layout.group_names}}
        device = present[0].device
        sq = torch.zeros(len(grads), dtype=torch.float32, device=device)
        idx = [i for i, g in enumerate(grads) if g is not None]
        sq[torch.tensor(idx, device=device)] = per_tensor_sq_norms(
            [g.to_dense() if g.is_sparse else g for g in present], device)
        return self._by_group(layout, sq, has=[g is not None for g in grads])

    def _weight_delta(self, layout: _Layout) -> Dict[str, Any]:
        named = list(zip(layout.names, layout.params))
        delta: Dict[str, Any] = {"overall": None, **{g: None for g in layout.group_names}}
        if os.path.exists(self.checkpoint_file):
            if reference_matches(self.checkpoint_file, named):
                delta = self._by_group(layout, streamed_sq_distances(named, self.checkpoint_file))
            else:
                self._warn_once("reference", "telemetry: the weight reference on disk does not match the "
                                             "model's trainable parameters; the delta restarts from here")
        self._write_file(write_tensor_file, self.checkpoint_file, named)
        return delta

    def _learning_rates(self, layout: _Layout) -> Dict[str, Any]:
        lrs = {name: read() for name, read in zip(layout.lr_names, layout.group_lrs)}
        plain = [v for v in lrs.values() if not isinstance(v, torch.Tensor)]
        tensors = [v for v in lrs.values() if isinstance(v, torch.Tensor)]
        overall = max(plain + [t.max() for t in tensors]) if tensors else max(plain, default=None)
        return {"overall": overall, **lrs}

    def _by_group(self, layout: _Layout, per_tensor_sq: torch.Tensor, has: Optional[List[bool]] = None):
        norms = group_norms(per_tensor_sq, layout.membership)
        out: Dict[str, Any] = {"overall": norms[:layout.first_partition].square().sum().sqrt()}
        counts = layout.membership.cpu() @ torch.tensor(has, dtype=torch.float32) if has is not None else None
        for i, name in enumerate(layout.group_names):
            out[name] = None if counts is not None and counts[i] == 0 else norms[i]
        return out

    def _evaluate_holdout(self, model: torch.nn.Module, device: Any) -> Dict[str, Any]:
        device = torch.device(device) if device is not None else _model_device(model)
        batches = self._holdout_on.get(str(device))
        if batches is None:
            batches = self._holdout_on[str(device)] = [move_to(b, device) for b in self._holdout]
        modes = [(m, m.training) for m in model.modules()]
        rng = _rng_state()
        all_logits, all_labels = [], []
        try:
            model.eval()
            with torch.no_grad():
                for batch in batches:
                    outputs, labels = self._holdout_forward_one(model, batch)
                    all_logits.append(output_logits(outputs))
                    all_labels.append(labels)
        finally:
            for module, mode in modes:
                module.training = mode
            _set_rng_state(rng)
        if all_logits[0].dim() == 3:
            width = max(t.shape[1] for t in all_logits)
            logits = torch.cat([_pad_seq(t, width, 0.0) for t in all_logits])
            labels = torch.cat([_pad_seq(t, width, IGNORE_INDEX) for t in all_labels])
            return language_model_holdout(logits, labels)
        return classification_holdout(torch.cat(all_logits), torch.cat([t.reshape(-1) for t in all_labels]))

    def _holdout_forward_one(self, model, batch):
        label_key = None
        if isinstance(batch, dict):
            label_key = find_label_key(batch, self.config.batch_label_key)
        if self._holdout_labels is not None:
            labels = self._holdout_labels(batch)
        elif isinstance(batch, dict):
            # A causal LM batch may carry only input_ids: its labels are the inputs themselves.
            labels = batch[label_key] if label_key is not None else batch.get("input_ids")
            if labels is None:
                raise KeyError(f"holdout batch has no label key (tried {', '.join(LABEL_KEYS)}); "
                               "set batch_label_key or pass labels= to set_holdout_data")
        else:
            labels = batch[-1]
        if self._holdout_forward is not None:
            return self._holdout_forward(model, batch), labels
        if isinstance(batch, dict):
            # Labels are never passed: fused-loss models (unsloth) return no logits when given labels.
            return model(**{k: v for k, v in batch.items() if k != label_key}), labels
        return model(*batch[:-1]), labels

    def _batch_stats(self, batch: Any) -> Dict[str, Any]:
        if isinstance(batch, dict):
            if isinstance(batch.get("input_ids"), torch.Tensor) and batch["input_ids"].dim() == 2:
                return token_balance(batch)
            key = find_label_key(batch, self.config.batch_label_key)
            if key is None:
                return {"batch_size": batch_size_of(batch)}
            return label_balance(batch[key], key)
        if isinstance(batch, (tuple, list)) and batch and isinstance(batch[-1], torch.Tensor):
            return label_balance(batch[-1], self.config.batch_label_key or "label")
        return {"batch_size": batch_size_of(batch)}

    # ---- groups ------------------------------------------------------------------------------------

    def _layout_for(self, model: torch.nn.Module, optimizer: Any) -> _Layout:
        opt_groups = getattr(optimizer, "param_groups", None) or []
        key = (id(model), id(optimizer), tuple(len(g["params"]) for g in opt_groups),
               sum(p.requires_grad for p in model.parameters()))
        if self._layout is not None and self._layout.key == key:
            return self._layout
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        names = [n for n, _ in named]
        params = [p for _, p in named]
        opt_index = {id(p): gi for gi, g in enumerate(opt_groups) for p in g["params"]}
        opt_names = [str(g.get("name") or f"group_{gi}") for gi, g in enumerate(opt_groups)]

        def lr_reader(gi):
            return (lambda: opt_groups[gi]["lr"]) if gi is not None else (lambda: 0.0)

        partitions: List[Dict[str, List[int]]] = []
        readers: Dict[str, Callable] = {}
        if self.config.groups:
            chosen: Dict[str, List[int]] = {g: [] for g in self.config.groups}
            for i, name in enumerate(names):
                group = next((g for g, pats in self.config.groups.items()
                              if any(param_matches(name, p) for p in pats)), "other")
                chosen.setdefault(group, []).append(i)
            partitions.append({g: idx for g, idx in chosen.items() if idx or g != "other"})
            for g, idx in partitions[0].items():
                held = [opt_index.get(id(params[i])) for i in idx]
                readers[g] = lr_reader(max(set(held), key=held.count) if held else None)
        elif opt_groups:
            by_opt: Dict[str, List[int]] = {n: [] for n in opt_names}
            for i, p in enumerate(params):
                gi = opt_index.get(id(p))
                by_opt.setdefault(opt_names[gi] if gi is not None else "not_in_optimizer", []).append(i)
            partitions.append(by_opt)
            for gi, n in enumerate(opt_names):
                readers[n] = lr_reader(gi)
            if by_opt.get("not_in_optimizer"):
                readers["not_in_optimizer"] = lr_reader(None)
        else:
            partitions.append({"all": list(range(len(params)))})
            readers["all"] = lr_reader(None)
        if self.config.groups and opt_groups:  # optimizer groups too, as the seed's record shows both
            for gi, n in enumerate(opt_names):
                if n not in partitions[0]:
                    readers[n] = lr_reader(gi)
        group_names = [g for part in partitions for g in part]
        membership = torch.zeros(len(group_names), len(params))
        for row, idx in enumerate(idx for part in partitions for idx in part.values()):
            membership[row, idx] = 1.0
        # Learning rates also name optimizer groups that hold no trainable parameter of their own here.
        lr_names = group_names + [n for n in readers if n not in group_names]
        self._layout = _Layout(key=key, names=names, params=params, group_names=group_names,
                               membership=membership, lr_names=lr_names,
                               group_lrs=[readers[g] for g in lr_names], first_partition=len(partitions[0]))
        self._describe_layout(model, optimizer, partitions)
        return self._layout

    def _describe_layout(self, model, optimizer, partitions) -> None:
        layout = self._layout
        all_params = list(model.parameters())
        groups = {}
        for part in partitions:
            for g, idx in part.items():
                groups[g] = {"tensors": len(idx), "elements": sum(layout.params[i].numel() for i in idx),
                             "names": [layout.names[i] for i in idx]}
        self._run_info.update(
            parameters={"total": sum(p.numel() for p in all_params),
                        "trainable": sum(p.numel() for p in layout.params)},
            groups=groups, optimizer=type(optimizer).__name__ if optimizer is not None else None,
            world_size=1, rank=0)
        self._write_run_info()

    # ---- checks ------------------------------------------------------------------------------------

    def _check_gradients(self, record: Dict[str, Any]) -> None:
        norms = record.get("gradient_norm")
        if not norms:
            return
        if norms.get("overall") is None:
            self._warn_once("no-grad", "telemetry: no gradients at collection time, recorded as null. "
                                       "Call on_batch_end after optimizer.step() and before zero_grad().")
        elif norms["overall"] == 0.0:
            self._warn_once("zero-grad", "telemetry: every gradient is exactly 0. If zero_grad() ran "
                                         "before on_batch_end, call on_batch_end before zero_grad().")

    # ---- I/O ---------------------------------------------------------------------------------------

    def _append(self, record: Dict[str, Any]) -> None:
        line = json.dumps(record, allow_nan=False, separators=(",", ":"), default=_json_default)
        self._write_file(self._append_line, line)

    def _append_line(self, line: str) -> None:
        if self._records is None:
            self._records = open(self.metrics_file, "a", encoding="utf-8")
            if self._records.tell() and not _ends_with_newline(self.metrics_file):
                self._records.write("\n")  # a torn last line from a crash stays on its own line
        self._records.write(line + "\n")
        self._records.flush()

    def _write_file(self, fn, *args) -> None:
        """Run a write; on a full or unwritable disk, warn once and stop collecting (training goes on)."""
        try:
            fn(*args)
        except OSError as exc:
            if self.config.strict:
                raise
            self._enabled = False
            self._warn_once("disk", f"telemetry: cannot write to {self.output_dir} ({exc}); telemetry is "
                                    "off for the rest of this run, training goes on")

    def _load_run_info(self) -> Dict[str, Any]:
        try:
            with open(self.run_file, encoding="utf-8") as f:
                info = json.load(f)
            info.setdefault("starts", [])
            return info
        except (OSError, ValueError):
            return {"starts": []}

    def _write_run_info(self) -> None:
        def write(path, info):
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                json.dump(info, f, indent=1, default=_json_default)
            os.replace(path + ".tmp", path)
        self._write_file(write, self.run_file, self._run_info)

    def _last_logged_step(self) -> int:
        """The step of the last readable record, so a resumed run keeps counting where it stopped."""
        try:
            with open(self.metrics_file, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                chunk = 1 << 16
                while True:
                    f.seek(max(0, size - chunk))
                    lines = f.read().splitlines()
                    for line in reversed(lines[1:] if size > chunk else lines):
                        try:
                            return int(json.loads(line)["step"])
                        except (ValueError, KeyError, TypeError):
                            continue
                    if size <= chunk:
                        return 0
                    chunk *= 4
        except OSError:
            return 0

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=4)


_SECTION_KEYS = {"gradient_norm", "weight_delta", "learning_rates", "holdout_logits", "batch_stats",
                 "telemetry_ms", "nonfinite", "errors", "schema"}


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _pad_seq(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = [0, 0] * (t.dim() - 2) + [0, width - t.shape[1]]
    return torch.nn.functional.pad(t, pad, value=value)


def _rng_state() -> Dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _json_default(value: Any) -> Any:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "item"):
        return value.item()
    return str(value)
