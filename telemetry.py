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

import bisect
import collections
import collections.abc
import contextlib
import ctypes
import dataclasses
import datetime
import errno
import difflib
import fnmatch
import functools
import hashlib
import itertools
import json
import logging
import math
import mmap
import numbers
import os
import random
import socket
import stat
import statistics
import sys
import threading
import time
import typing
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

try:
    import fcntl  # POSIX: the lock that keeps a second writer out of a run directory
except ImportError:
    fcntl = None

SCHEMA_VERSION = 1
RECORDS_FILE = "telemetry.jsonl"
RUN_FILE = "run.json"
REFERENCE_FILE = "last_checkpoint.safetensors"
INITIAL_FILE = "initial_weights.safetensors"  # W_0 of drift, written once
LOCK_FILE = "telemetry.lock"  # held by the one writer of a run directory
# Names of the files telemetry keeps in output_dir (with their .rank/.spare/.tmp variants).
_OWN_FILES = (RECORDS_FILE, RUN_FILE, LOCK_FILE, "last_checkpoint", "initial_weights")
# Record keys that user scalars passed to on_batch_end may not take.
_SECTION_KEYS = {"start", "reference_step", "grad_profile", "activations", "gradient_norm", "weight_delta",
                 "learning_rates", "holdout_logits", "batch_stats", "telemetry_ms", "nonfinite", "errors", "schema", "lora", "trainer",
                 "layer_stats", "nonfinite_params", "update_ratio", "drift", "weight_norm", "param_change",
                 "sparse_quality", "alerts", "system", "custom", "grad_scaler", "grads_never_zeroed", "eval_mode",
                 "accumulation"}
_GRAD_STATS = ("grad_norm", "grad_mean", "grad_std", "grad_min", "grad_max", "zeros", "nans", "infs")
MIN_ALERT_HISTORY = 8  # records in a window before spikes are judged against it
# A spike is also at least this multiple of the rolling median, as the analyzer's loss spikes are: a short
# window of a noisy run (small batches) can hold too little of its spread, and a robust z alone then makes
# a spike of the run's ordinary values.
SPIKE_MIN_RATIO = 2.0
SPIKE_VISIBLE = 0.05  # ... and a loss spike rises by this share of the run's first losses (their highest)
SPIKE_PAST_WORST = 10.0  # a loss this many times the worst in the alert window is a spike whatever its z
_LOGGER = logging.getLogger("telemetry")
IGNORE_INDEX = -100  # label value that HF losses skip (padding, prompt tokens)
# Dict keys tried, in order, when the config names no label key ("winner": pairwise-preference labels).
LABEL_KEYS = ("labels", "label", "winner", "target", "targets", "y")
MAX_LOGGED_CLASSES = 64  # above this, holdout logits are summarised instead of stored per class
MAX_BALANCE_VALUES = 32  # above this many distinct labels, batch balance is summarised
CHUNK_BYTES = 2 << 20  # files are streamed in pieces this big: a few per thread stay in cache and bound extra RSS
PARALLEL_PASS_BYTES = 32 << 20  # a streamed pass over fewer CPU bytes than this runs on one thread
MAX_PASS_THREADS = 4  # memory bandwidth stops growing with threads well before the core count does
WHOLE_PASS_BYTES = 16 << 20  # up to this many trainable bytes the pass takes whole tensors, list-wide
# Weights on a GPU are passed in blocks of this many bytes of the files: a few host copies and list-wide ops
# per block, where chunks of CHUNK_BYTES cost the host a dozen calls each. A few blocks of each file are in
# flight at once, in pinned host memory and on the device.
DEVICE_BLOCK_BYTES = 32 << 20
# A tensor smaller than this costs more per op or write than its bytes: on the CPU, tensors of one shape are
# stacked to be measured together, and runs of them are written to a file as one block (from a device, runs
# of any tensors up to DEVICE_BLOCK_BYTES are).
SMALL_TENSOR_BYTES = 64 << 10
MIN_STACKED = 16  # fewer such tensors cost less one by one than copied together (measured)
FUSED_MIN_ELEMENTS = 1 << 14  # the compiled kernel is specialised to chunks at least this long
# Dropping a map's pages after use keeps RSS flat (MADV_DONTNEED; absent on Windows, where they stay).
_CAN_RELEASE_PAGES = hasattr(mmap.mmap, "madvise") and hasattr(mmap, "MADV_DONTNEED")
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound: a damaged header length never allocates more
# Files are opened without following a planted link where the OS can say so (POSIX), and not inherited.
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


# =====================================================================================================
# Config
# =====================================================================================================


LAYER_STATS_BY = ("layer", "group", "tensor")
# Group names that telemetry itself gives: a configured group of that name would overwrite its numbers.
RESERVED_GROUPS = ("overall", "other", "not_in_optimizer", "all", "lora_A", "lora_B", "lora_magnitude")


MIRRORS = ("wandb", "tensorboard")


# Presets are plain overrides of the defaults; `preset:` in YAML applies one before the other keys.
_PRESETS: Dict[str, Dict[str, Any]] = {
    "minimal": dict(track_weight_delta=False, track_update_ratio=False, track_holdout_logits=False,
                    track_batch_stats=False, track_layer_stats=False, track_param_change=False,
                    track_sparse_quality=False),
    "default": {},
    "comprehensive": dict(track_gradients=True, track_weight_delta=True, track_learning_rates=True,
                          track_holdout_logits=True, track_batch_stats=True, track_layer_stats=True,
                          track_update_ratio=True, track_param_change=True, track_sparse_quality=True,
                          track_system=True, alerts=True),
}


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
    if os.path.islink(path) and not os.path.exists(path):
        raise ValueError(f"{name}: {path!r} is a symbolic link to nothing ({os.readlink(path)!r})")
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
    track_activations: bool = True  # dead ReLU and saturated sigmoid/tanh units, seen in the holdout's forward
    track_batch_stats: bool = True  # label balance of the batch passed to on_batch_end

    holdout_size: int = 50  # number of holdout *examples* (not batches) kept from set_holdout_data
    # Group name -> parameter-name patterns. A pattern is a glob ("backbone.*") or a dotted segment run
    # ("head", "lora_A") matched anywhere in the name. Unset: the optimizer's param groups, by "name".
    groups: Optional[Dict[str, List[str]]] = None
    batch_label_key: Optional[str] = None  # label key in dict batches; unset: the first of LABEL_KEYS found
    strict: bool = False  # raise metric errors instead of recording them (tests use this)

    # LoRA and language models.
    track_lora: bool = True  # with LoRA modules (peft/unsloth): the `lora` section and lora_A/lora_B groups
    holdout_token_ids: Optional[List[int]] = None  # LM holdout: log these tokens' logits per example

    # Training dynamics. The defaults stay cheap; the expensive analyses are off until asked for.
    track_layer_stats: bool = False  # per-layer gradient mean/std/min/max/zero/NaN/Inf counts and weight norm
    layer_stats_by: str = "layer"  # "layer" (index / module name), "group" or "tensor": rows per record
    track_update_ratio: bool = True  # ||dW||/||W||, drift ||W - W_0|| and ||W|| per group, from the delta's pass
    track_param_change: bool = False  # L1/L2/max/mean/std, sparsity and sign flips of the delta
    # |dW| <= t counts as unchanged; absolute thresholds.
    param_change_thresholds: List[float] = dataclasses.field(default_factory=lambda: [1e-8, 1e-6, 1e-4])
    # |dW| <= t * |W|: scale-free, so a bf16 rounding step (~4e-3 relative) reads as a change.
    param_change_rel_thresholds: List[float] = dataclasses.field(default_factory=lambda: [1e-4, 1e-3, 1e-2])
    track_sparse_quality: bool = False  # holdout outputs with only |dW| > t applied vs the full update
    sparse_quality_thresholds: List[float] = dataclasses.field(default_factory=lambda: [1e-8, 1e-6, 1e-4])
    track_system: bool = True  # step time, throughput, RSS, CUDA memory: a few clock/counter reads
    alerts: bool = True  # online alerts (spikes, NaN, LR 0, frozen groups), logged when they start
    alert_window: int = 50  # records in the rolling median/MAD window of loss and gradient norm
    alert_spike_threshold: float = 8.0  # robust z-score (MADs from the rolling median) that makes a spike
    alert_explosion_factor: float = 10.0  # a gradient spike this many times its rolling median: explosion

    # Mirrors: each record's numbers also go to "wandb" (the active run) and/or "tensorboard" (output_dir/tb).
    mirror: List[str] = dataclasses.field(default_factory=list)  # telemetry.jsonl stays the source of truth

    def __post_init__(self):
        if isinstance(self.output_dir, os.PathLike):
            self.output_dir = os.fspath(self.output_dir)
        if isinstance(self.groups, dict):
            self.groups = {k: [v] if isinstance(v, str) else v for k, v in self.groups.items()}
        if isinstance(self.mirror, str):  # `mirror: wandb` in YAML
            self.mirror = [self.mirror]
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), hints[f.name])
        for name, low in (("collect_every_n", 1), ("holdout_size", 0), ("alert_window", 5)):
            if getattr(self, name) < low:
                why = " (a median of fewer is no baseline)" if name == "alert_window" else ""
                raise ValueError(f"{name}: must be >= {low}{why}, got {getattr(self, name)}")
        unknown = [m for m in self.mirror if m not in MIRRORS]
        if unknown:
            raise ValueError(f"mirror: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(MIRRORS)}")
        if self.layer_stats_by not in LAYER_STATS_BY:
            raise ValueError(f"layer_stats_by: must be one of {', '.join(LAYER_STATS_BY)}, "
                             f"got {self.layer_stats_by!r}")
        for name in ("param_change_thresholds", "param_change_rel_thresholds", "sparse_quality_thresholds"):
            values = [float(v) for v in getattr(self, name)]
            if any(not math.isfinite(v) or v < 0 for v in values):
                raise ValueError(f"{name}: thresholds must be finite and >= 0, got {values}")
            setattr(self, name, values)
        for name, low in (("alert_spike_threshold", 0.0), ("alert_explosion_factor", 1.0)):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= low:
                raise ValueError(f"{name}: must be a finite number > {low:g}, got {value}")
        self._check_names()
        if self.enabled and self.output_dir is not None:
            _check_writable_dir("output_dir", self.output_dir)

    def _check_names(self) -> None:
        if self.output_dir is not None and not self.output_dir.strip():
            raise ValueError("output_dir: must not be empty (a directory path, e.g. runs/exp1)")
        if self.batch_label_key is not None and not self.batch_label_key:
            raise ValueError("batch_label_key: must not be empty (null finds the label key)")
        if any(t < 0 for t in self.holdout_token_ids or []):
            raise ValueError(f"holdout_token_ids: token ids are >= 0, got {self.holdout_token_ids}")
        for group, patterns in (self.groups or {}).items():
            if group in RESERVED_GROUPS or not group:
                raise ValueError(f"groups: {group!r} cannot name a group (reserved: {', '.join(RESERVED_GROUPS)})")
            if not patterns or any(not p for p in patterns):
                raise ValueError(f"groups: group {group!r} needs at least one non-empty pattern, got {patterns}")

    @property
    def keeps_reference(self) -> bool:
        """Whether collections stream and rewrite the weight reference (several sections share one pass)."""
        return self.track_weight_delta or self.track_update_ratio or self.track_param_change or self.track_sparse_quality

    @classmethod
    def from_dict(cls, config_dict: Dict[str, Any]) -> "TelemetryConfig":
        """Build from a dict (e.g. a YAML section). Unknown keys are an error, never silently dropped."""
        if not isinstance(config_dict, dict):
            raise ValueError(f"telemetry config: expected a mapping, got {type(config_dict).__name__}")
        if "preset" in config_dict:  # the preset first, then every other key on top of it
            config_dict = dict(config_dict)
            preset = config_dict.pop("preset")
            if not isinstance(preset, str) or preset not in _PRESETS:
                raise ValueError(f"preset: must be one of {', '.join(_PRESETS)}, got {preset!r}")
            config_dict = {**_PRESETS[preset], **config_dict}
        known = [f.name for f in dataclasses.fields(cls)]
        for key in config_dict:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"; did you mean {close[0]}?" if close else f"; valid keys: {', '.join(known)}"
                raise ValueError(f"unknown telemetry config key {key!r}{hint}")
        return cls(**config_dict)

    @classmethod
    def minimal(cls, **overrides: Any) -> "TelemetryConfig":
        """Gradient norms, learning rates, system metrics and alerts: no disk reference, no forward passes."""
        return cls.from_dict({"preset": "minimal", **overrides})

    @classmethod
    def comprehensive(cls, **overrides: Any) -> "TelemetryConfig":
        """Everything, including per-layer statistics, parameter-change statistics and sparse quality."""
        return cls.from_dict({"preset": "comprehensive", **overrides})

    @classmethod
    def from_yaml(cls, path: str, **overrides: Any) -> "TelemetryConfig":
        """Read a YAML file (flat, or its top-level `telemetry:` section); keyword arguments override it.
        A file that is empty, not UTF-8, not a mapping, or that repeats a key is an error naming it."""
        data = _read_yaml(os.fspath(path))
        if isinstance(data, dict) and isinstance(data.get("telemetry"), dict):
            data = data["telemetry"]
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of telemetry keys, got a {type(data).__name__}")
        try:
            return cls.from_dict({**data, **overrides})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from None


def _read_yaml(path: str) -> Any:
    import yaml  # lazy: the module must import with torch alone

    class UniqueKeys(yaml.SafeLoader):
        """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, collections.abc.Hashable) and key in seen:
                    raise ValueError(f"key {key!r} is given twice (line {key_node.start_mark.line + 1})")
                seen.add(key)
            return super().construct_mapping(node, deep)

    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
        data = yaml.load(text, Loader=UniqueKeys)  # a SafeLoader: no Python objects are built
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML ({exc})") from None
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    if data is None:
        raise ValueError(f"{path}: the file is empty; write the telemetry keys in it (see telemetry.yaml), "
                         "or build TelemetryConfig() without a file")
    return data


# =====================================================================================================
# Metrics: pure functions of tensors, no I/O; results stay on the device (one transfer per record)
# =====================================================================================================


def per_tensor_sq_norms(tensors: List[torch.Tensor], device: Optional[torch.device] = None) -> torch.Tensor:
    """Squared L2 norm of each tensor, as one float32 vector [len(tensors)] on `device`.

    ||t||^2 for every t, computed with torch._foreach_norm per (device, dtype) bucket (the clip_grad_norm_
    fast path) in float32, so fp16/bf16 norms neither overflow nor lose precision (float64 tensors in
    float64). No host sync.
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.float32, device=device or "cpu")
    device = device or tensors[0].device
    buckets: Dict[Any, List[int]] = {}
    for i, t in enumerate(tensors):
        buckets.setdefault((t.device, t.dtype), []).append(i)
    out = torch.empty(len(tensors), dtype=torch.float32, device=device) if len(buckets) > 1 else None
    for (dev, dtype), idx in buckets.items():
        bucket = [tensors[i] for i in idx]
        threads, work = _pass_threads(bucket), _work_dtype(dtype)
        groups, rest = _same_shape_groups(bucket) if threads == 1 else ([], [])
        if groups:  # many small CPU tensors of a few shapes (LoRA's): a stack per shape, the rest list-wide
            sq = torch.empty(len(bucket), dtype=torch.float32, device=dev)
            for members in groups:
                sq[members] = _stacked_sq_norms([bucket[i] for i in members], None, work)
            if rest:
                sq[rest] = _squared_norms([bucket[i] for i in rest], work)
        elif threads == 1:
            sq = _squared_norms(bucket, work)
        else:  # a large CPU bucket: each thread norms an equal share of pieces of the tensors, then they add up
            owner, pieces = [], []
            for k, t in enumerate(bucket):
                parts = t.view(-1).chunk(threads) if t.is_contiguous() and t.numel() else [t]
                owner += [k] * len(parts)
                pieces += parts
            runs = _split_evenly([(j, 0, piece.numel()) for j, piece in enumerate(pieces)], threads)
            norms = [norm for part in _concurrently(*[
                lambda run=run: torch._foreach_norm([pieces[j] for j, *_ in run], 2, dtype=work)
                for run in runs]) for norm in part]
            sq = torch.zeros(len(bucket), dtype=work, device=dev).index_add_(
                0, torch.tensor(owner, device=dev), torch.stack(norms).square()).float()
        if out is None:  # one device and dtype, the common case: sq is every tensor's, in order
            return sq.to(device)
        out[torch.tensor(idx, device=device)] = sq.to(device)
    return out


def _small(t: torch.Tensor) -> bool:
    """A tensor under SMALL_TENSOR_BYTES."""
    return t.numel() * t.element_size() < SMALL_TENSOR_BYTES


def _small_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and _small(t)


def _same_shape_groups(tensors: List[torch.Tensor]) -> tuple:
    """([indices of small CPU tensors of one shape and dtype, in groups of MIN_STACKED or more], [the others]):
    a group is measured as one stack, where hundreds of small tensors (a LoRA model's) would each cost an
    op's fixed cost several times over (see SMALL_TENSOR_BYTES)."""
    if len(tensors) < MIN_STACKED:
        return [], list(range(len(tensors)))
    groups: Dict[tuple, List[int]] = {}
    for i, t in enumerate(tensors):
        if _small_cpu(t):
            groups.setdefault((t.shape, t.dtype), []).append(i)
    stacked = [idx for idx in groups.values() if len(idx) >= MIN_STACKED]
    taken = {i for idx in stacked for i in idx}
    return stacked, [i for i in range(len(tensors)) if i not in taken]


def _stacked_sq_norms(tensors: List[torch.Tensor], minus: Optional[List[torch.Tensor]],
                      work: torch.dtype) -> torch.Tensor:
    """||t - m||^2 (||t||^2 without `minus`) of tensors of one shape, from one stack, in `work`, as float32."""
    x = torch.stack(tensors).to(work)
    if minus is not None:
        x = x - torch.stack(minus).to(work)
    return x.square().reshape(len(tensors), -1).sum(1).float()  # 0-dim tensors stack to one dimension


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor's norms and differences are computed in: float32, or float64 for float64 tensors,
    whose small differences float32 would round away."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def group_norms(per_tensor_sq: torch.Tensor, membership: torch.Tensor) -> torch.Tensor:
    """Per-group L2 norms from per-tensor squared norms: sqrt(M @ sq), M[g, i] = 1 if tensor i is in g.

    Groups of one partition are disjoint, so their squared norms add up to the overall squared norm.
    """
    return (membership.to(per_tensor_sq.device) @ per_tensor_sq).sqrt()


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.is_sparse else t


def classification_holdout(logits: torch.Tensor, labels: torch.Tensor,
                           maybe_probabilities: Optional[torch.Tensor] = None) -> Dict[str, Any]:
    """Accuracy, mean loss and per-example predictions for [N, C] (or [N] / [N, 1] binary) logits.

    [N, C] outputs use softmax/CE with prediction = argmax. One output per example is a logit (sigmoid/BCE,
    prediction = output > 0), unless `maybe_probabilities` (a bool tensor: no earlier evaluation's outputs
    left [0, 1]) is given and true and every output lies in [0, 1]: then they are probabilities, a model
    ending in a sigmoid, trained with BCELoss (BCE on them, prediction = output > 0.5), and the section's
    `probabilities` is true. A model of logits leaves [0, 1] once it has learned anything (class 0 gets
    negative ones). Returns tensors; nothing is moved to the host here (the reading is chosen on the device).
    """
    logits = logits.detach().float()
    labels = labels.detach().to(logits.device).reshape(-1)
    probabilities = None
    if logits.dim() == 1 or logits.shape[-1] == 1:
        logits = logits.reshape(-1)
        predictions = (logits > 0).long()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.float())
        if maybe_probabilities is not None:
            probabilities = maybe_probabilities.to(logits.device) & ((logits >= 0) & (logits <= 1)).all()
            predictions = torch.where(probabilities, (logits > 0.5).long(), predictions)
            loss = torch.where(probabilities, _probability_bce(logits, labels.float()), loss)
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
    if probabilities is not None:
        out["probabilities"] = probabilities
    return out


def _probability_bce(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # By hand, not F.binary_cross_entropy: on CUDA that asserts on the device for an input outside [0, 1] (a
    # NaN too), which ends the process's CUDA context. Clamped as the analyzer reads probabilities.
    p = p.clamp(0, 1)
    return -(y * p.clamp_min(1e-7).log() + (1 - y) * (1 - p).clamp_min(1e-7).log()).mean()


def text_positions(mask: Any, shape: Any) -> Optional[torch.Tensor]:
    """Where a batch's `attention_mask` [N, T] marks text (True) rather than padding, or None where there is no
    such mask of `shape`. A mask that holds anything but 0 and 1 (an additive one, 0 where attended) says
    nothing of padding here, and marks every position text. No sync: the check stays on the device."""
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(shape) or mask.dim() != 2:
        return None
    mask = mask.detach()
    return (mask != 0) | ~((mask == 0) | (mask == 1)).all()


def language_model_holdout(logits: torch.Tensor, labels: torch.Tensor,
                           token_ids: Optional[List[int]] = None, shift: bool = True,
                           ahead: bool = False, attention_mask: Optional[torch.Tensor] = None) -> Dict[str, Any]:
    """Per-example mean token NLL and top-1 token accuracy for per-token logits [N, T, V].

    With `shift`, labels are the inputs' own tokens, which an HF causal LM shifts itself: position t
    predicts token t+1. Without it, position t is scored against labels[:, t] (a tagger, a masked LM, a
    decoder's targets, or next tokens shifted already). Positions labelled IGNORE_INDEX are skipped, and with
    `shift` so are the predictions made at padding (attention_mask 0): a left-padded row's first token would
    be scored from padding alone, which no unpadded row is, and its scores would depend on the side it is
    padded on. The full
    [N, T, V] logits are never kept. With `token_ids`, `token_logits` [N, len(token_ids)] holds those tokens'
    logits at the position that predicts each example's first supervised token (e.g. the answer after a
    masked prompt; the last position if none is supervised).
    With `shift`, `copy_accuracy` is the share of those positions whose top prediction is the token at the
    position itself: a model trained on labels that were never shifted learns to copy its input, and
    scores near 1 there while its next-token accuracy is low. With `ahead` (labels that are the tokens of a
    text), `ahead_accuracy` is the share of positions whose top prediction is the token after the one scored:
    a model trained on labels shifted twice (shifted already, then by a model that shifts them again) learns
    that token, and scores better there than on the one it is scored on.
    """
    logits, target = logits.detach(), labels.detach().to(logits.device)
    here = None
    if shift:
        logits, here, target = logits[:, :-1, :], target[:, :-1].long(), target[:, 1:]
    logits, target = logits.float(), target.long()
    valid = target != IGNORE_INDEX
    text = text_positions(attention_mask, labels.shape) if shift else None
    if text is not None:
        valid = valid & text[:, :-1].to(valid.device)
    nll = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), target.clamp(min=0), reduction="none") * valid
    predicted = logits.argmax(-1)
    correct = (predicted == target) & valid
    tokens = valid.sum(1)
    per_tokens = tokens.clamp(min=1).float()
    all_tokens = tokens.sum().clamp(min=1)
    out = {"kind": "lm", "shifted": shift, "nll": nll.sum(1) / per_tokens,
           "token_accuracy": correct.sum(1) / per_tokens, "loss": nll.sum() / all_tokens,
           "accuracy": correct.sum() / all_tokens, "tokens": tokens}
    if here is not None:
        out["copy_accuracy"] = ((predicted == here) & valid).sum() / all_tokens
    if ahead:
        after = valid[:, :-1] & valid[:, 1:]
        out["ahead_accuracy"] = ((predicted[:, :-1] == target[:, 1:]) & after).sum() / after.sum().clamp(min=1)
    if token_ids:
        first = torch.where(valid.any(1), valid.int().argmax(1), valid.shape[1] - 1)  # argmax: first max
        rows = logits[torch.arange(logits.shape[0], device=logits.device), first]
        out.update(token_ids=list(token_ids), token_logits=rows[:, torch.tensor(token_ids, device=rows.device)])
    return out


def merge_lm_holdout(parts: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Combine language_model_holdout results of several batches: per-example lists are concatenated and
    loss/accuracy are re-weighted by each batch's supervised token count, as if computed in one batch."""
    if len(parts) == 1:
        return parts[0]
    out = dict(parts[0])
    for key in ("nll", "token_accuracy", "tokens", "token_logits"):
        if key in out:
            out[key] = torch.cat([p[key] for p in parts])
    tokens = torch.stack([p["tokens"].sum() for p in parts]).float()
    total = tokens.sum().clamp(min=1)
    out["loss"] = (torch.stack([p["loss"] for p in parts]) * tokens).sum() / total
    for key in ("accuracy", "copy_accuracy", "ahead_accuracy"):
        if key in out:
            out[key] = (torch.stack([p[key].float() for p in parts]) * tokens).sum() / total
    return out


def _valid_positions(logits: torch.Tensor, labels: Any, shift: bool, mask: Any = None) -> Optional[torch.Tensor]:
    # Per-token logits [N, T, V]: position t counts when the token it predicts is supervised (as in the
    # holdout: token t+1 with shift, and then only at a position of the text, not its padding; else token t).
    if logits.dim() != 3 or not isinstance(labels, torch.Tensor) or tuple(labels.shape) != tuple(logits.shape[:2]):
        return None
    labels = labels.to(logits.device)
    if not shift:
        return labels != IGNORE_INDEX
    valid = torch.zeros(labels.shape, dtype=torch.bool, device=logits.device)
    valid[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    text = text_positions(mask, labels.shape)
    return valid if text is None else valid & text.to(logits.device)


def label_balance(labels: torch.Tensor, key: str) -> Dict[str, Any]:
    """Count and percentage of each label value in a batch, under "<key>_<value>_pct" keys. Host numbers:
    the counts are needed to build the keys, so this is the one metric that copies to the host itself."""
    values = labels.detach().reshape(-1).cpu()
    stats: Dict[str, Any] = {"batch_size": int(labels.shape[0]) if labels.dim() else 1, "label_key": key}
    if is_regression_target(values) or _multi_label(values.view(labels.shape)):  # the host copy, not another
        return stats  # a regression target, or several 0/1 targets per example, has no classes to balance
    values = values.long()
    kept = values[values != IGNORE_INDEX]  # positions the loss skips (a tagger's padding) are no class
    if kept.numel() < values.numel():
        stats["ignored_share"] = 1 - kept.numel() / values.numel()
    uniq, counts = torch.unique(kept, return_counts=True)
    total = max(int(kept.numel()), 1)
    if len(uniq) > MAX_BALANCE_VALUES:
        stats.update(distinct_labels=len(uniq), max_label_pct=100.0 * int(counts.max()) / total)
        return stats
    stats["counts"] = {str(v): c for v, c in zip(uniq.tolist(), counts.tolist())}
    for v, c in zip(uniq.tolist(), counts.tolist()):
        stats[f"{key}_{v}_pct"] = 100.0 * c / total
    return stats


def token_balance(batch: Dict[str, Any]) -> Dict[str, Any]:
    """Tokens, share of supervised label positions and padding share of a language-model batch, and the share
    of positions that are padding yet supervised (labels other than IGNORE_INDEX where attention_mask is 0)."""
    ids = batch["input_ids"]
    stats: Dict[str, Any] = {"batch_size": int(ids.shape[0]), "tokens": int(ids.numel())}
    if isinstance(batch.get("labels"), torch.Tensor):
        stats["label_share"] = (batch["labels"] != IGNORE_INDEX).float().mean()
    text = text_positions(batch.get("attention_mask"), ids.shape)
    if text is not None:
        stats["padding_share"] = (~text).float().mean()
        labels = batch.get("labels")
        if isinstance(labels, torch.Tensor) and labels.shape == text.shape:  # padding the loss still supervises
            stats["padding_supervised"] = (~text & (labels.to(text.device) != IGNORE_INDEX)).float().mean()
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


def output_logits(outputs: Any, output: Any = None) -> torch.Tensor:
    """The predictions in a model's output: `output` picks them (an index, a key or attribute, or a callable
    of the output); without it, a tensor, `.logits` (HF), or the one tensor of a dict or tuple. A dict or
    tuple of several tensors is ambiguous (features and logits, say): a TypeError that names output=."""
    if callable(output):
        return output(outputs)
    if output is not None:
        if isinstance(output, str) and not isinstance(outputs, dict):
            return getattr(outputs, output)
        return outputs[output]
    if isinstance(outputs, torch.Tensor):
        return outputs
    if getattr(outputs, "logits", None) is not None:
        return outputs.logits
    if isinstance(outputs, dict) and "logits" in outputs:
        return outputs["logits"]
    items = list(outputs.items()) if isinstance(outputs, dict) else (
        list(enumerate(outputs)) if isinstance(outputs, (tuple, list)) else [])
    tensors = [(k, v) for k, v in items if isinstance(v, torch.Tensor)]
    if len(tensors) == 1:
        return tensors[0][1]
    if tensors:
        shown = ", ".join(f"{k!r}: {list(v.shape)}" for k, v in tensors[:6])
        raise TypeError(f"the model returns {len(tensors)} tensors ({shown}); pass output= to set_holdout_data "
                        "to say which holds the predictions (an index, a key, or a callable of the output)")
    raise TypeError(f"cannot find predictions in model output of type {type(outputs).__name__}; pass output= "
                    "(or forward=) to set_holdout_data")


def is_regression_target(labels: torch.Tensor) -> bool:
    """Float targets other than 0/1 are regression targets; integer labels and float 0/1 (BCE) are classes.
    Host values: called once per holdout, and by label_balance, which copies its labels anyway."""
    values = labels.detach().cpu()
    return values.is_floating_point() and not _zero_one(values)


def _multi_label(labels: torch.Tensor) -> bool:
    """Several 0/1 targets per example (multi-label or one-hot), in any dtype: [N, C] labels with C > 1
    (0/1 masks of more dimensions are a segmentation's). Host values, as is_regression_target."""
    if labels.dim() != 2 or labels[0].numel() < 2:
        return False
    values = labels.detach().cpu()
    return values.dtype == torch.bool or _zero_one(values)


def _zero_one(values: torch.Tensor) -> bool:
    return bool(((values == 0) | (values == 1)).all())


def regression_holdout(predictions: torch.Tensor, targets: torch.Tensor) -> Dict[str, Any]:
    """Per-example squared and absolute error, averaged over the outputs, and their means over the holdout
    (loss is the MSE). Predictions [N] or [N, k] against targets of the same size. No host sync."""
    n = predictions.shape[0]
    pred = predictions.detach().float().reshape(n, -1)
    target = targets.detach().to(pred.device).float().reshape(n, -1)
    if pred.shape != target.shape:
        classes = target.shape[1] == 1 and bool((target == target.round()).all()) and bool(
            ((target >= 0) & (target < pred.shape[1])).all())
        fix = ("they look like class indices stored as floats: pass labels=lambda batch: batch[-1].long() to "
               "set_holdout_data, or integer labels" if classes else "pass output= or forward= to set_holdout_data")
        raise ValueError(f"regression holdout: predictions of shape {list(predictions.shape)} against float targets "
                         f"of shape {list(targets.shape)}; {fix}")
    err = pred - target
    squared, absolute = err.square().mean(1), err.abs().mean(1)
    out: Dict[str, Any] = {"kind": "regression", "outputs": pred.shape[1]}
    if pred.shape[1] <= MAX_LOGGED_CLASSES:
        shown = (lambda t: t.reshape(-1)) if pred.shape[1] == 1 else (lambda t: t)
        out.update(predictions=shown(pred), targets=shown(target))
    out.update(squared_error=squared, abs_error=absolute, loss=squared.mean(), mae=absolute.mean())
    return out


# ---- batches: examples along dim 0 of every tensor leaf --------------------------------------------


def plain_batch(batch: Any) -> Any:
    """A mapping that is not a dict (transformers' BatchEncoding is a UserDict) as a dict of its items, so
    that it is read as the dict batch it stands for; anything else as it is."""
    return dict(batch) if isinstance(batch, collections.abc.Mapping) and not isinstance(batch, dict) else batch


def batch_size_of(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    batch = plain_batch(batch)
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else []
    for item in items:
        if isinstance(item, torch.Tensor) and item.dim():
            return int(item.shape[0])
    raise TypeError(f"cannot tell the batch size of a {type(batch).__name__}")


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """The batch with fn applied to every tensor leaf: mappings (as dicts), lists and tuples (named ones too)
    are rebuilt, other leaves kept."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, collections.abc.Mapping):
        return {k: map_tensors(fn, v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple takes its fields one by one
        return type(batch)(*(map_tensors(fn, v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(fn, v) for v in batch)
    return batch


def slice_batch(batch: Any, n: int) -> Any:
    """The first n examples of a batch (tensors along dim 0; other leaves unchanged)."""
    return map_tensors(lambda t: t[:n] if t.dim() else t, batch)


def move_to(batch: Any, device: torch.device) -> Any:
    return map_tensors(lambda t: t.to(device), batch)


# ---- records: one transfer to the host, strict JSON ------------------------------------------------


def _wide(device: torch.device) -> torch.dtype:
    """The dtype sums are taken in on `device`: float64, or float32 on mps, which has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def _pinned_copy(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x)


def _to_device(x: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """x on dev. From CPU memory to a CUDA device through a pinned block: the host copy into it is the only
    wait, and the transfer runs while the caller goes on. torch's caching host allocator hands the block out
    again only once the transfer has finished."""
    if x.device.type == "cpu" and dev.type == "cuda":
        return _pinned_copy(x).to(dev, non_blocking=True)
    return x.to(dev)


def to_host(record: Dict[str, Any]) -> Dict[str, Any]:
    """Replace every tensor in a nested record by Python numbers, with one device-to-host copy per device.

    All tensor leaves on a device are flattened into one float64 vector, copied once, and split back, so a
    record costs one sync however many norms it holds. Integer and bool tensors come back as int/bool.
    """
    return host_record(record)[0]


def host_record(record: Dict[str, Any]) -> tuple:
    """(to_host(record), whether any float in it is NaN/Inf): one walk copies the record and notes where its
    tensors sit, one transfer fills them in."""
    leaves: List[torch.Tensor] = []
    slots: List[tuple] = []  # (container in the copy, key) of each leaf
    flags = [False]

    def copy(node):
        out = dict(node) if isinstance(node, dict) else list(node)
        for k, v in out.items() if isinstance(out, dict) else enumerate(out):
            # Plain numbers and strings first: most of a record, and cheaper to rule out than a Tensor.
            if isinstance(v, float):
                if not math.isfinite(v):
                    flags[0] = True
            elif isinstance(v, (int, str)) or v is None:
                pass
            elif isinstance(v, torch.Tensor):
                leaves.append(v)
                slots.append((out, k))
            elif isinstance(v, (dict, list, tuple)):
                out[k] = copy(v)
        return out

    root = copy([record])
    values, nonfinite = _leaves_on_host(leaves)
    for (out, k), value in zip(slots, values):
        out[k] = value
    return root[0], flags[0] or nonfinite


def _leaves_on_host(leaves: List[torch.Tensor]) -> tuple:
    """([each leaf's value as Python numbers], whether a float leaf holds NaN/Inf), one copy per device.
    Scalars of one dtype are stacked with one op, so a record of many norms costs a few ops, not one each."""
    by_device: Dict[torch.device, List[int]] = {}
    for i, t in enumerate(leaves):
        by_device.setdefault(t.device, []).append(i)
    host: List[Any] = [None] * len(leaves)
    nonfinite = False
    for dev, idx in by_device.items():
        wide = _wide(dev)
        groups: Dict[Any, List[int]] = {}
        for i in idx:
            groups.setdefault(leaves[i].dtype if leaves[i].dim() == 0 else i, []).append(i)
        order = [i for members in groups.values() for i in members]
        parts = [torch.stack([leaves[i].detach() for i in members]).reshape(-1).to(wide)
                 for members in groups.values()]
        flat = (parts[0] if len(parts) == 1 else torch.cat(parts)).cpu().tolist()
        nonfinite = nonfinite or not math.isfinite(sum(flat))  # NaN/Inf spread through the sum (or it overflowed)
        pos = 0
        for i in order:
            t = leaves[i]
            n = t.numel()
            chunk = flat[pos:pos + n]
            pos += n
            if not t.is_floating_point():
                chunk = [bool(v) for v in chunk] if t.dtype == torch.bool else [int(v) for v in chunk]
            elif t.dtype != torch.float64:  # 9 significant digits round-trip float32 exactly, in half the text
                chunk = [float(f"{v:.9g}") for v in chunk]
            host[i] = chunk[0] if t.dim() == 0 else _reshape(chunk, list(t.shape))
    return host, nonfinite


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


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _has_nonfinite(node: Any) -> bool:
    if isinstance(node, float):
        return not math.isfinite(node)
    if isinstance(node, dict):
        return any(_has_nonfinite(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_nonfinite(v) for v in node)
    return False


# What the mirrors leave out of a record: a dashboard wants one curve per section and group. Bookkeeping
# (the step is the mirrors' x axis), rows per layer (telemetry.jsonl and the analyzer's heatmaps keep them)
# and counts are no curves; a batch's class balance goes out as shares (see batch_shares).
_MIRROR_LEFT_OUT = ("schema", "step", "batch_idx", "timestamp", "start", "reference_step",
                    "layer_stats", "grad_profile", "activations", "param_change/per_layer",
                    "lora/adapter_norm/layer_*", "lora/adapter_delta/layer_*", "lora/modules",
                    "holdout_logits/num_classes", "holdout_logits/outputs", "holdout_logits/padding_positions",
                    "holdout_logits/padding_full_precision",
                    "batch_stats/counts",
                    "batch_stats/*_pct", "batch_stats/batch_size", "batch_stats/tokens", "batch_stats/distinct_labels",
                    "batch_stats/input_elements", "batch_stats/holdout_matches", "batch_stats/holdout_checked",
                    "batch_stats/checked_pairs",
                    "grads_never_zeroed", "eval_mode", "accumulation")


def flatten_scalars(record: Dict[str, Any], prefix: str = "telemetry", classes: Any = ()) -> Dict[str, float]:
    """A record's numbers under mirror keys, one per section and group: {"telemetry/gradient_norm/head": 0.5}.

    Nested keys are joined by "/"; lists (predictions, alerts), strings, bools and nulls are left out, and
    so is _MIRROR_LEFT_OUT. Batch balance is `batch_share/<class>` (see batch_shares), for the classes of
    this batch and `classes`, those seen earlier in the run.
    """
    out: Dict[str, float] = {}

    def walk(node, path):
        if any(fnmatch.fnmatchcase(path, pattern) for pattern in _MIRROR_LEFT_OUT):
            return
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}/{key}" if path else str(key))
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            out[f"{prefix}/{path}"] = float(node)

    walk(record, "")
    stats = record.get("batch_stats")
    out.update((f"{prefix}/batch_share/{c}", v) for c, v in batch_shares(stats, classes).items())
    return out


def batch_shares(stats: Any, classes: Any = ()) -> Dict[str, float]:
    """{class: share of the batch} from a batch_stats section's counts, with 0 for each of `classes` the
    batch lacks: a class seen once keeps a value (its curve no gap) at every later record."""
    counts = stats.get("counts") if isinstance(stats, dict) else None
    counts = counts if isinstance(counts, dict) else {}
    total = sum(c for c in counts.values() if isinstance(c, (int, float))) or 1
    shares = {str(c): 0.0 for c in classes}
    shares.update((str(c), n / total) for c, n in counts.items() if isinstance(n, (int, float)))
    return shares


def _json_default(value: Any) -> Any:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "item"):
        return value.item()
    return str(value)


# ---- LoRA: duck-typed, so peft's and unsloth's layers both qualify and neither is imported ---------


def find_lora_modules(model: torch.nn.Module) -> List[tuple]:
    """(module name, module, adapter name) for every active LoRA adapter of every LoRA module, in model order.

    A LoRA module has `lora_A` and `lora_B` containers keyed by adapter name (peft's nn.ModuleDict, which
    unsloth reuses; a plain dict passes too) and a `scaling` dict with one entry per adapter. Where the module
    names its `active_adapters` (peft), the others are left out: an adapter kept beside the one in training
    takes no part in the forward, and its numbers would hide those of the trained one (an adapter at zero).
    """
    found = []
    for name, module in model.named_modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and hasattr(module, "lora_A") and hasattr(module, "lora_B"):
            active = getattr(module, "active_adapters", None)
            active = [active] if isinstance(active, str) else active
            found.extend((name, module, adapter) for adapter in scaling
                         if (not isinstance(active, (list, tuple)) or adapter in active)
                         and lora_factors(module, adapter))
    return found


def lora_factors(module: torch.nn.Module, adapter: str) -> Optional[tuple]:
    """The (A, B) parameters of one adapter, with dW = scaling * B @ A for A as [r, fan_in], B as [fan_out, r].

    Linear and conv LoRA keep modules in lora_A/lora_B (conv A is [r, in, k, k], B a 1x1 [out, r, 1, 1]);
    embedding LoRA keeps bare parameters in lora_embedding_A/B. Anything else is not a low-rank pair: None.
    """
    for a_key, b_key in (("lora_A", "lora_B"), ("lora_embedding_A", "lora_embedding_B")):
        a_box, b_box = getattr(module, a_key, None), getattr(module, b_key, None)
        if a_box is None or b_box is None or adapter not in a_box or adapter not in b_box:
            continue
        a, b = (getattr(x, "weight", x) for x in (a_box[adapter], b_box[adapter]))
        if (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() >= 2 and b.dim() >= 2
                and math.prod(b.shape[1:]) == a.shape[0]):
            return a, b
    return None


def dora_magnitude(module: torch.nn.Module, adapter: str) -> Optional[torch.Tensor]:
    """DoRA's per-output-row magnitude vector m (peft's `lora_magnitude_vector`), or None without DoRA."""
    box = getattr(module, "lora_magnitude_vector", None)
    if box is None or adapter not in box:
        return None
    m = getattr(box[adapter], "weight", box[adapter])
    return m if isinstance(m, torch.Tensor) else None


@functools.lru_cache(maxsize=1 << 16)  # called for every adapter at every collection, with the same names
def layer_index(name: str) -> Optional[int]:
    """The block index in a module name: 7 for "base_model.model.model.layers.7.self_attn.q_proj"."""
    parts = name.split(".")
    for container, index in zip(parts, parts[1:]):
        if container in ("layers", "layer", "h", "blocks", "block") and index.isdigit():
            return int(index)
    return None


def _lora_mats(a: torch.Tensor, b: torch.Tensor) -> tuple:
    # Wide (see _wide) on A's device: Grams of float32 factors then stay exact to ~1e-16.
    wide = _wide(a.device)
    return a.detach().to(wide), b.detach().to(a.device, wide)


def lora_grams(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """(B^T B, A A^T), the two r x r Gram matrices of a pair, wide: A is [r, fan_in] and B [fan_out, r], or
    stacks of them ([m, r, fan_in], [m, fan_out, r]). Cost r^2 (fan_in + fan_out): the dense B A is never formed."""
    a, b = _lora_mats(a, b)
    return b.mT @ b, a @ a.mT


def lora_norm_sq(a: torch.Tensor, b: torch.Tensor, scale: Any) -> torch.Tensor:
    """||s B A||_F^2 = s^2 <B^T B, A A^T> (shapes as lora_grams; s a scalar or one per pair of a stack).

    ||BA||^2 = tr(A^T B^T B A) = tr((B^T B)(A A^T)), and a trace of a product of symmetric matrices is their
    elementwise inner product.
    """
    gb, ga = lora_grams(a, b)
    return (gb * ga).sum((-2, -1)) * (scale * scale)


def lora_delta_sq(a: torch.Tensor, b: torch.Tensor, a_prev: torch.Tensor, b_prev: torch.Tensor,
                  scale: Any) -> torch.Tensor:
    """||s B A - s B0 A0||_F^2 from 2r x 2r Gram matrices, without cancellation (shapes as lora_norm_sq).

    B A - B0 A0 = (B - B0) A + B0 (A - A0) = P Q with P = [B - B0, B0] (fan_out x 2r) and Q = [A; A - A0]
    (2r x fan_in), so the squared norm is s^2 <P^T P, Q Q^T>. Every term is of the order of the change, so
    a small step of a large adapter keeps full precision; expanding ||BA||^2 + ||B0A0||^2 - 2<BA, B0A0>
    would lose it. Both states use the current scaling s.
    """
    a, b = _lora_mats(a, b)
    a0, b0 = a_prev.to(a.device, a.dtype), b_prev.to(a.device, a.dtype)
    p = torch.cat([b - b0, b0], dim=-1)
    q = torch.cat([a, a - a0], dim=-2)
    return ((p.mT @ p) * (q @ q.mT)).sum((-2, -1)) * (scale * scale)


def stable_ranks(gb: torch.Tensor, ga: torch.Tensor) -> torch.Tensor:
    """||B A||_F^2 / sigma_max(B A)^2 of each pair of a stack, from its Grams [m, r, r] (lora_grams): 0 for a
    zero product, NaN where a Gram is not finite.

    sigma_max^2 is the top eigenvalue of (B^T B)(A A^T). With A A^T = S S^T (S = V sqrt(L) from its eigh), that
    product has the eigenvalues of the symmetric S^T B^T B S: two batched r x r eigensolves. QRs of the
    fan_out x r and fan_in x r factors give the same to rounding but cost milliseconds per adapter shape on a
    GPU, and in float64 the Grams lose nothing that matters to the largest eigenvalue.
    """
    if gb.device.type not in ("cpu", "cuda"):  # not every backend has eigh (mps lacked it): r x r on the CPU
        return stable_ranks(gb.cpu().double(), ga.cpu().double()).to(gb.device, gb.dtype)
    finite = gb.isfinite().all(-1).all(-1) & ga.isfinite().all(-1).all(-1)
    gb, ga = (torch.where(finite[:, None, None], g, 0.0) for g in (gb, ga))  # eigh refuses non-finite input
    values, vectors = torch.linalg.eigh(ga)
    s = vectors * values.clamp(min=0).sqrt().unsqueeze(-2)
    top = torch.linalg.eigvalsh(s.mT @ gb @ s)[:, -1]
    ranks = torch.where(top > 0, (gb * ga).sum((-2, -1)) / top.clamp(min=torch.finfo(top.dtype).tiny), 0.0)
    return torch.where(finite, ranks, torch.nan)


def _by_layer(values_sq: torch.Tensor, layers: List[Optional[int]]) -> Dict[str, Any]:
    # Root-sum-square: the Frobenius norm of all adapters of a layer (and of the model) taken together.
    out: Dict[str, Any] = {"overall": values_sq.sum().sqrt()}
    index = sorted({i for i in layers if i is not None})
    if index:
        rows = _to_device(torch.tensor([index.index(i) if i is not None else len(index) for i in layers]),
                          values_sq.device)
        per = torch.zeros(len(index) + 1, dtype=values_sq.dtype, device=values_sq.device)
        per = per.index_add(0, rows, values_sq).sqrt()
        out.update((f"layer_{i}", per[k]) for k, i in enumerate(index))
    return out


def _stacked(tensors: List[torch.Tensor], shape: tuple, device: torch.device) -> torch.Tensor:
    """The tensors (all of one shape), stacked and viewed as [len, *shape] on `device` in the wide dtype: from
    CPU memory (a file's) in one transfer, where one per small tensor would cost more than its bytes. One
    stack and one reshape: a model's hundreds of adapters make a call per tensor cost more than the data."""
    with torch.no_grad():
        if all(t.device == device for t in tensors):
            stacked = torch.stack(tensors)
        elif device.type != "cpu" and all(t.device.type == "cpu" for t in tensors):
            stacked = _to_device(torch.stack(tensors), device)
        else:
            stacked = torch.stack([t.to(device) for t in tensors])
    return stacked.reshape(len(tensors), *shape).to(_wide(device))


def _scales(scales: List[Any], device: torch.device) -> torch.Tensor:
    if all(isinstance(s, (int, float)) for s in scales):
        return torch.tensor(scales, dtype=_wide(device), device=device)
    return torch.stack([torch.as_tensor(s).to(device, _wide(device)) for s in scales])


def lora_stats(entries: List[tuple], previous: Optional[Any] = None) -> Dict[str, Any]:
    """The `lora` record section from [(module name, A, B, scale)] (see lora_factors).

    `previous` yields (A0, B0) for each entry, in order, as of the last collection; None (no reference yet)
    leaves adapter_delta null. Norms are Frobenius norms of dW = s B A, combined over modules (and per layer
    index) by root-sum-square. For DoRA they cover the low-rank part s B A, not the magnitude rescaling.
    Adapters of one shape are stacked and measured together: a model's hundreds of adapters come to a few
    batched products and eigensolves rather than several small ones each.
    """
    prev = list(previous) if previous is not None else None
    device = entries[0][1].device
    shapes: Dict[tuple, List[int]] = {}  # adapters of one shape (and device): measured as one stack
    for k, (_, a, b, _) in enumerate(entries):
        shapes.setdefault((a.device, a.shape, b.shape), []).append(k)
    parts: Dict[str, List[torch.Tensor]] = {"norm_sq": [], "delta_sq": [], "ranks": [], "b_nonzero": []}
    grad_sq = {"A": [], "B": []}
    for (dev, a_full, b_full), idx in shapes.items():
        r = a_full[0]
        a_shape, b_shape = (r, a_full.numel() // r), (b_full.numel() // r, r)
        a = _stacked([entries[k][1] for k in idx], a_shape, dev)
        b = _stacked([entries[k][2] for k in idx], b_shape, dev)
        scale = _scales([entries[k][3] for k in idx], dev)
        gb, ga = lora_grams(a, b)
        parts["norm_sq"].append(((gb * ga).sum((-2, -1)) * (scale * scale)).to(device))
        if prev is not None:
            a0 = _stacked([prev[k][0] for k in idx], a_shape, dev)
            b0 = _stacked([prev[k][1] for k in idx], b_shape, dev)
            parts["delta_sq"].append(lora_delta_sq(a, b, a0, b0, scale).to(device))
        parts["ranks"].append(stable_ranks(gb, ga).to(device))
        parts["b_nonzero"].append(b.ne(0).flatten(1).any(1).to(device))
        for key, col in (("A", 1), ("B", 2)):  # a stack of a group's gradients: one op, not one per tensor
            grads = [entries[k][col].grad for k in idx if entries[k][col].grad is not None]
            if grads:
                grad_sq[key].append(_stacked(grads, (grads[0].numel(),), dev).square().sum().to(device))
    order = _to_device(torch.tensor([k for idx in shapes.values() for k in idx]), device)

    def in_order(key):  # the groups' values back in the entries' order: one index for all groups
        values = torch.cat(parts[key])
        return torch.empty_like(values).index_copy_(0, order, values)
    norm_sq, ranks, b_nonzero = in_order("norm_sq"), in_order("ranks"), in_order("b_nonzero")
    layers = [layer_index(name) for name, *_ in entries]
    norms = _by_layer(norm_sq, layers)

    def grad_norm(key):
        return torch.stack(grad_sq[key]).sum().sqrt() if grad_sq[key] else None

    return {"modules": len(entries), "adapter_norm": norms,
            "adapter_delta": (_by_layer(in_order("delta_sq"), layers) if prev is not None else
                              {k: None for k in norms}),
            "grad_norm_A": grad_norm("A"), "grad_norm_B": grad_norm("B"),
            "b_zero_fraction": 1.0 - b_nonzero.float().mean(),
            "stable_rank": {"min": ranks.min(), "median": ranks.quantile(0.5), "max": ranks.max()}}


def relative_drift(current: List[torch.Tensor], start: List[torch.Tensor]) -> torch.Tensor:
    """||x - x_0|| / ||x_0|| over all tensors taken together (e.g. DoRA magnitude vectors)."""
    device = current[0].device
    diff = sum(torch.linalg.vector_norm(c.detach().float() - s.to(c.device).float()).square().to(device)
               for c, s in zip(current, start))
    base = sum(torch.linalg.vector_norm(s.float()).square().to(device) for s in start)
    return (diff / base).sqrt()


# ---- training dynamics: per-layer statistics, breakdowns, output agreement, robust spikes ----------


# Transformer-block components that param_change breaks the delta down by, matched as dotted name segments.
COMPONENTS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj",
              "gate_up_proj")


def threshold_key(t: float) -> str:
    """Record key of a threshold: 1e-06 -> "1e-06"; 2.5e-4 -> "0.00025" (never rounded)."""
    short = f"{t:.0e}"
    return short if float(short) == t else repr(float(t))


def layer_key(name: str) -> str:
    """The layer of a parameter: its name up to the first numeric segment (a block index), else its module.

    "model.layers.3.mlp.up_proj.weight" -> "model.layers.3", "backbone.0.weight" -> "backbone.0",
    "head.weight" -> "head": a 70-block model gives ~70 rows, not one per tensor.
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1]) or name


def component_of(name: str) -> Optional[str]:
    """The transformer component (q_proj, ..., down_proj) a parameter belongs to, or None."""
    return next((c for c in COMPONENTS if param_matches(name, c)), None)


def _buckets(tensors: List[torch.Tensor]) -> Dict[Any, List[int]]:
    out: Dict[Any, List[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel():  # foreach max/inf-norm have no identity for empty tensors
            out.setdefault((t.device, t.dtype), []).append(i)
    return out


def layer_entries(rows: List[str], pooled: Optional[Dict[str, torch.Tensor]], with_grad: set,
                  weight_norm: torch.Tensor) -> Dict[str, Any]:
    """The layer_stats section: pooled gradient statistics per row (None where no gradient), plus weight norm."""
    out = {}
    for r, row in enumerate(rows):
        entry = {k: (pooled[k][r] if pooled is not None and r in with_grad else None) for k in _GRAD_STATS}
        entry["weight_norm"] = weight_norm[r]
        out[row] = entry
    return out


def per_tensor_stats(tensors: List[torch.Tensor], device: torch.device,
                     nonfinite_counts: bool = True) -> Dict[str, torch.Tensor]:
    """Per-tensor sufficient statistics of gradients, as vectors [len(tensors)] on `device`.

    sq = sum g^2 and max = max g via torch._foreach_norm / _foreach_max per (device, dtype); sum = sum g,
    min = min g and the counts zeros = #(g == 0), nans = #isnan(g), infs = #isinf(g) take one reduction per
    tensor (no foreach op computes them). Floats are float32, counts int64; no host sync. Empty tensors give
    sq = sum = 0, min = +inf, max = -inf: the identities of the pooling in `pool_stats`.
    nonfinite_counts=False leaves nans = infs = 0, two passes fewer: right whenever every sum comes out
    finite (a NaN or an Inf makes the sum non-finite), so a caller can count again only when one does not.
    """
    n = len(tensors)
    out = {"sq": torch.zeros(n, dtype=torch.float32, device=device),
           "max": torch.full((n,), -math.inf, dtype=torch.float32, device=device)}
    for (_, _), idx in _buckets(tensors).items():
        group = [tensors[i] for i in idx]
        where = torch.tensor(idx, device=device)
        out["sq"][where] = torch.stack(torch._foreach_norm(group, 2, dtype=torch.float32)).square().to(device)
        out["max"][where] = torch.stack(torch._foreach_max(group)).float().to(device)
    zero_f = torch.zeros((), dtype=torch.float32, device=device)
    zero_i = torch.zeros((), dtype=torch.int64, device=device)
    per: Dict[str, List[torch.Tensor]] = {"sum": [], "min": [], "zeros": [], "nans": [], "infs": []}
    for t in tensors:
        if not t.numel():
            for k, v in (("sum", zero_f), ("min", torch.full((), math.inf, device=device)), ("zeros", zero_i),
                         ("nans", zero_i), ("infs", zero_i)):
                per[k].append(v)
            continue
        per["sum"].append(t.sum(dtype=torch.float32).to(device))
        per["min"].append(t.amin().float().to(device))
        per["zeros"].append((t.numel() - torch.count_nonzero(t)).to(device))  # NaN is not zero
        per["nans"].append(torch.count_nonzero(t.isnan()).to(device) if nonfinite_counts else zero_i)
        per["infs"].append(torch.count_nonzero(t.isinf()).to(device) if nonfinite_counts else zero_i)
    for k, values in per.items():
        out[k] = torch.stack(values) if values else torch.zeros(0, device=device)
    out["numel"] = torch.tensor([t.numel() for t in tensors], dtype=torch.int64, device=device)
    return out


def pool_stats(stats: Dict[str, torch.Tensor], index: torch.Tensor, rows: int) -> Dict[str, torch.Tensor]:
    """Pool per-tensor statistics into `rows` rows; tensor i goes to row index[i].

    n = sum numel, mean = sum(sum) / n, std = sqrt(max(sum(sq) / n - mean^2, 0)) (population std, over every
    element of the row), norm = sqrt(sum(sq)), min/max/counts as their reductions. Moments in float64
    (float32 on mps, which has no float64).
    """
    device = stats["sq"].device
    wide = _wide(device)
    index = index.to(device)

    def total(v, dtype):
        return torch.zeros(rows, dtype=dtype, device=device).index_add_(0, index, v.to(dtype))

    n = total(stats["numel"], wide).clamp(min=1)
    mean = total(stats["sum"], wide) / n
    sq = total(stats["sq"], wide)
    return {"grad_norm": sq.sqrt(), "grad_mean": mean, "grad_std": (sq / n - mean.square()).clamp(min=0).sqrt(),
            "grad_min": torch.full((rows,), math.inf, device=device).scatter_reduce(
                0, index, stats["min"], "amin"),
            "grad_max": torch.full((rows,), -math.inf, device=device).scatter_reduce(
                0, index, stats["max"], "amax"),
            "zeros": total(stats["zeros"], torch.int64), "nans": total(stats["nans"], torch.int64),
            "infs": total(stats["infs"], torch.int64)}


def per_tensor_finite(tensors: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Bool [len(tensors)]: no NaN/Inf in the tensor (its inf-norm, max |t|, is finite). One foreach per bucket."""
    out = torch.ones(len(tensors), dtype=torch.bool, device=device)
    for (_, _), idx in _buckets(tensors).items():
        norms = torch._foreach_norm([tensors[i] for i in idx], math.inf)
        out[torch.tensor(idx, device=device)] = torch.stack(norms).isfinite().to(device)
    return out


def logit_agreement(reference: torch.Tensor, other: torch.Tensor,
                    valid: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """How far `other` logits are from `reference` logits, as sums over positions (so batches add up).

    Logits are [..., C]; a single binary logit x is read as the two classes [0, x]. With p = softmax(ref),
    q = softmax(other), over the positions where `valid` ([...] bool) holds:
      kl = sum_pos sum_c p_c (log p_c - log q_c)        (KL(reference || other), >= 0, 0 iff equal)
      cosine = sum_pos cos(ref_pos, other_pos),  sq = sum_pos sum_c (ref - other)^2,
      agree = sum_pos [argmax ref_pos == argmax other_pos],  positions,  elements = positions * C.
    Divide kl, cosine, agree by positions and sq by elements for the means. No host sync.
    """
    ref, oth = reference.detach().float(), other.detach().float().to(reference.device)
    if ref.dim() == 1 or ref.shape[-1] == 1:
        ref, oth = ref.reshape(-1, 1), oth.reshape(-1, 1)
        width = 1
        ref, oth = torch.cat([torch.zeros_like(ref), ref], -1), torch.cat([torch.zeros_like(oth), oth], -1)
    else:
        width = ref.shape[-1]
        ref, oth = ref.reshape(-1, width), oth.reshape(-1, width)
    weight = (torch.ones(ref.shape[0], device=ref.device) if valid is None
              else valid.reshape(-1).to(ref.device).float())
    log_p, log_q = ref.log_softmax(-1), oth.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    cosine = torch.nn.functional.cosine_similarity(ref, oth, dim=-1)
    positions = weight.sum()
    return {"kl": (kl * weight).sum(), "cosine": (cosine * weight).sum(),
            "sq": ((ref - oth).square().sum(-1) * weight).sum(),
            "agree": ((ref.argmax(-1) == oth.argmax(-1)).float() * weight).sum(),
            "positions": positions, "elements": positions * width}


def robust_z(history: Any, value: float) -> float:
    """Robust z-score of `value` against `history`: (value - median) / (1.4826 * MAD).

    Taken on a log scale when no value is negative and one is > 0 (loss and gradient norms vary
    multiplicatively, so the noise late in training, when they are small, is not mistaken for spikes); a 0 (a
    float32 cross-entropy of a batch of one the model is sure of) counts as the least value above 0 there,
    since on the linear scale one wrong example among right ones would pass for a spike. The scale has a
    floor (5% on the log scale, 1e-3 * |median| otherwise) so that a tight stretch of history, MAD near 0,
    does not make a spike of a rise of a few percent: at the default threshold of 8, a z-score alone asks for
    at least 1.49x the median (the alerts ask for SPIKE_MIN_RATIO besides).
    Plain floats: it runs on the host record, after the one transfer.
    """
    values = list(history)
    least = min((v for v in values if v > 0), default=0.0)
    if least > 0 and value >= 0 and all(v >= 0 for v in values):
        values, value = [math.log(v or least) for v in values], math.log(value or least)
        floor = 0.05
    else:
        floor = 0.0
    values.sort()
    mid = len(values) // 2
    median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    deviations = sorted(abs(v - median) for v in values)
    mad = deviations[mid] if len(values) % 2 else (deviations[mid - 1] + deviations[mid]) / 2
    scale = max(1.4826 * mad, floor, 1e-3 * abs(median), 1e-12)
    return (value - median) / scale


# ---- distributed: which part of each tensor this rank holds ----------------------------------------


def is_sharded(t: Any) -> bool:
    """A DTensor (FSDP2's fully_shard, tensor parallel): each rank holds only its local part."""
    return hasattr(t, "to_local") and hasattr(t, "placements") and hasattr(t, "device_mesh")


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` that this rank holds: DTensor.to_local() (a view, no communication), else `t`."""
    return t.to_local() if is_sharded(t) else t


def replica_weights(tensors: List[torch.Tensor], world_size: int) -> torch.Tensor:
    """1 / (ranks that hold the same data as this rank) per tensor, float32 [len(tensors)].

    sum over ranks of w * (a sum over this rank's part) = that sum over the whole tensor. A DTensor's Shard
    placements cut it into prod(mesh sizes of its Shard dims) disjoint parts, each held by
    world_size / that many ranks (its Replicate dims: HSDP's replica groups); a plain tensor is whole on
    every rank. Every rank must hold the same tensors (SPMD: DDP, FSDP2, HSDP, TP). A Partial placement is
    an unreduced sum, whose norm is not a sum over ranks: it raises.
    """
    weights = []
    for t in tensors:
        parts = 1
        if is_sharded(t):
            for dim, placement in enumerate(t.placements):
                if placement.is_partial():
                    raise ValueError("a DTensor with a Partial placement holds unreduced values; read it "
                                     "after its reduction")
                if placement.is_shard():
                    parts *= t.device_mesh.size(dim)
        weights.append(parts / world_size)
    return torch.tensor(weights, dtype=torch.float32)


def rank_share(batch: Any, rank: int, world_size: int) -> tuple:
    """(this rank's contiguous share of a batch's examples, True), as torch.tensor_split cuts them; a batch
    with fewer examples than ranks is not split: (the whole batch, False). Every rank gets one forward per
    batch either way, which a collective forward (FSDP2) needs."""
    n = batch_size_of(batch)
    if n < world_size or world_size == 1:
        return batch, False
    start = rank * (n // world_size) + min(rank, n % world_size)
    stop = start + n // world_size + (1 if rank < n % world_size else 0)
    return map_tensors(lambda x: x[start:stop] if x.dim() and x.shape[0] == n else x, batch), True


def full_gradient(param: torch.Tensor) -> Optional[torch.Tensor]:
    """param.grad; for a DeepSpeed ZeRO parameter whose .grad is None, deepspeed's safe_get_full_grad.

    ZeRO-1/2 keep the reduced gradient in the optimizer's flat partitions and ZeRO-3 partitions the
    parameter itself, so .grad stays None. safe_get_full_grad assembles the full fp32 gradient; it is a
    collective, valid between engine.backward() and engine.step(), which is why DeepSpeed runs make every
    rank collect. Without deepspeed importable there is nothing to assemble from: None (recorded as null).
    """
    if param.grad is not None or not (hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")):
        return param.grad
    try:
        from deepspeed.utils import safe_get_full_grad  # lazy: only DeepSpeed runs have it
    except ImportError:
        return None
    return safe_get_full_grad(param)


# =====================================================================================================
# Weight reference on disk: the safetensors layout, written and read one tensor at a time, never pickled
# =====================================================================================================


_DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                torch.uint8: "U8", torch.bool: "BOOL"}


_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}
_DATA_ALIGN = 4096


def write_tensor_file(path: str, named: List[tuple], meanwhile: Optional[Callable[[], Any]] = None,
                      metadata: Optional[Dict[str, str]] = None, header: Optional[tuple] = None) -> Any:
    """Write [(name, tensor)] as a safetensors file, streaming from the tensors' own memory; `metadata`
    ({str: str}) goes in the header's __metadata__.

    `meanwhile(put)`, if given, runs during the write and its result is returned: the file at `path` is still
    the old one until it is done, so it may read that. With every tensor in CPU memory it runs on this
    thread, on threads of its own if it likes, and hands over the data as it reads it: put(i, start, values)
    writes `values`, tensor i's elements from `start` on, at their place in the file while they are still in
    the processor's cache, sparing the write a second pass over the weights in memory.
    What it did not hand over is written after it. From a device, put is None and the data is written on a
    thread of its own meanwhile: there the pass waits on copies to the device and the write on copies back.

    Atomic: the data goes to a side file that os.replace then moves over `path`, so a crash mid-write
    leaves the previous file intact. The replaced file is kept (hard link) as `path.spare` and overwritten
    in place next time: rewriting pages the page cache already holds is much faster than filling a new file.
    The side file is created afresh (whatever stood at its name, a planted link included, is removed, never
    written through). No fsync: this is a cache that a power cut may lose; tensor_file_info refuses what
    such a cut leaves half-written, and fsync per collection would dominate its cost.
    `header`: what tensor_file_header(named, metadata) gives, when the caller has it already.
    """
    header, blob = header or tensor_file_header(named, metadata)
    size = 8 + len(blob) + sum(t.numel() * t.element_size() for _, t in named)
    spare = path + ".spare"
    f = _open_spare(spare, size)
    target = spare if f is not None else path + ".tmp"
    try:
        if f is None:
            f = os.fdopen(_create_exclusive(target), "wb")
        with f:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            f.flush()
            tensors = [t.detach() for _, t in named]
            starts = [8 + len(blob) + header[name]["data_offsets"][0] for name, _ in named]
            handed = [0] * len(tensors)  # elements put() wrote, per tensor
            lock = threading.Lock()

            def put(i: int, start: int, values: torch.Tensor) -> None:
                _pwrite_all(f.fileno(), _bytes_of(values), starts[i] + start * values.element_size())
                with lock:
                    handed[i] += values.numel()

            def joins(run: List[int], i: int) -> bool:
                # Consecutive tensors of one device and dtype go as one block: in CPU memory small ones up to
                # CHUNK_BYTES, from MIN_STACKED on (see SMALL_TENSOR_BYTES); on a device any up to
                # DEVICE_BLOCK_BYTES, since each piece from a GPU costs a transfer and a wait.
                t, first = tensors[i], tensors[run[0]]
                span = starts[i] + t.numel() * t.element_size() - starts[run[0]]
                if (t.device, t.dtype) != (first.device, first.dtype):
                    return False
                if t.device.type == "cpu":
                    return _small(t) and _small(first) and span <= CHUNK_BYTES
                return span <= DEVICE_BLOCK_BYTES

            def write_data():
                # What put() did not write, run by run: a run is one tensor, or consecutive ones that joins().
                runs: List[List[int]] = []
                for i, t in enumerate(tensors):
                    run = runs[-1] if runs else []
                    if handed[i] == t.numel():
                        runs.append([])  # written already: the next tensor is not next to the last in the file
                    elif run and joins(run, i):
                        run.append(i)
                    else:
                        runs.append([i])
                for run in filter(None, runs):
                    f.seek(starts[run[0]])
                    least = MIN_STACKED if tensors[run[0]].device.type == "cpu" else 2
                    blocks = [torch.cat([tensors[k].reshape(-1) for k in run])] if len(run) >= least else \
                        [tensors[k] for k in run]
                    for block in blocks:
                        for chunk in _host_chunks(block):
                            f.write(chunk)

            result = None
            if meanwhile is None:
                write_data()
            elif all(t.device.type == "cpu" for t in tensors):
                result = meanwhile(put)
                write_data()
            else:  # the data on a thread and a stream of its own, after the work the caller queued
                stream = _side_stream(tensors)
                result = _concurrently(lambda: meanwhile(None), lambda: _on_stream(stream, write_data))[0]
        if os.path.lexists(path):
            _replace_keeping_old(target, path, spare)
        else:
            os.replace(target, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(target)
        raise
    return result


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:  # a regular file takes it whole unless the disk fills up part way, which then raises
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def _side_stream(tensors: List[torch.Tensor]) -> Optional[Any]:
    """A CUDA stream of its own on the first CUDA tensor's device (None without one), ordered after the work
    this thread has queued on its current stream, which may be a training loop's own: the copies back to the
    host that go on it run beside the pass's copies to the device instead of queued behind them."""
    cuda = next((t.device for t in tensors if t.device.type == "cuda"), None)
    if cuda is None:
        return None
    side = torch.cuda.Stream(cuda)
    side.wait_stream(torch.cuda.current_stream(cuda))
    return side


def _on_stream(stream: Optional[Any], fn: Callable[[], Any]) -> Any:
    """fn() with `stream` (from _side_stream) current: a thread's own current stream is the default one,
    which need not be ordered after the work a training loop queued on a stream of its own."""
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        return fn()


_HEADER_ENTRIES: Dict[tuple, tuple] = {}  # a few layouts' tensor entries: (entries, their JSON)


def tensor_file_header(named: List[tuple], metadata: Optional[Dict[str, str]] = None) -> tuple:
    """(header as tensor_file_info gives it, the header's bytes) of the safetensors file of [(name, tensor)].
    The tensors' entries are encoded once per layout (names, dtypes and shapes), and only the metadata at
    every write: hundreds of tensors make a JSON that costs a collection more than its data."""
    key = tuple((name, t.dtype, t.shape) for name, t in named)
    known = _HEADER_ENTRIES.get(key)
    if known is None:
        entries: Dict[str, Any] = {}
        offset = 0
        for name, t in named:
            nbytes = t.numel() * t.element_size()
            entries[name] = {"dtype": _DTYPE_CODES[t.dtype], "shape": list(t.shape),
                             "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        if len(_HEADER_ENTRIES) >= 4:  # a run's layouts: the reference's and W_0's are the same one
            _HEADER_ENTRIES.pop(next(iter(_HEADER_ENTRIES)))
        known = _HEADER_ENTRIES[key] = (entries, json.dumps(entries, separators=(",", ":")))
    entries, text = known
    header = {"__metadata__": dict(metadata), **entries} if metadata else dict(entries)
    if metadata:  # the same bytes json.dumps(header) gives: the metadata first, then the entries
        text = '{"__metadata__":' + json.dumps(header["__metadata__"], separators=(",", ":")) + \
            ("," + text[1:] if entries else "}")
    blob = text.encode()
    # The data section starts on a page boundary (safetensors allows a header padded with spaces): at some
    # offsets the kernel copies a write into the page cache several times slower.
    blob += b" " * (-(8 + len(blob)) % _DATA_ALIGN)
    return header, blob


def _open_spare(spare: str, size: int) -> Any:
    """The spare copy opened for rewriting in place, when it is a regular file of exactly `size` bytes."""
    try:
        st = os.lstat(spare)
        if st.st_size != size or st.st_nlink != 1:  # another name for it (a user's hard link) keeps it as it is
            return None
        return open_regular(spare, write=True)
    except OSError:
        return None


def _create_exclusive(path: str) -> int:
    """A new, empty file at `path`, opened for writing. What stood there (a stale side file from a crash, or
    a planted link) is removed first and never written through; O_EXCL makes a race an error."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o644)


def open_regular(path: str, write: bool = False) -> Any:
    """A binary file object for `path` when it is a regular file; anything else (a FIFO, a socket, a device,
    a directory, a symbolic link) is an OSError at once, never a hang in open() or a write elsewhere."""
    fd = os.open(path, (os.O_RDWR if write else os.O_RDONLY) | os.O_NONBLOCK | _O_NOFOLLOW | _O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "r+b" if write else "rb")
    except BaseException:
        os.close(fd)
        raise


def _concurrently(*calls: Callable[[], Any]) -> List[Any]:
    """[call() for call in calls], the first on this thread and each other on a thread of its own. An error
    is raised once all have stopped (the first, in the order of `calls`)."""
    results: List[Any] = [None] * len(calls)
    failures: List[Optional[BaseException]] = [None] * len(calls)

    def run(k):
        try:
            results[k] = calls[k]()
        except BaseException as exc:  # handed to the caller below
            failures[k] = exc

    threads = [threading.Thread(target=run, args=(k,), name="telemetry", daemon=True) for k in range(1, len(calls))]
    for thread in threads:
        thread.start()
    try:
        run(0)
    finally:
        for thread in threads:
            thread.join()
    for failure in failures:
        if failure is not None:
            raise failure
    return results


def _pass_threads(tensors: List[torch.Tensor]) -> int:
    """Threads for a memory-bound pass over these tensors: one per core (at most MAX_PASS_THREADS) for CPU
    tensors of PARALLEL_PASS_BYTES or more, else one. Each runs single-threaded torch ops, so a busy core
    slows its share down but never stalls the others as a blocked OpenMP team would."""
    if any(t.device.type != "cpu" for t in tensors) or not _large_pass(tensors):
        return 1
    return _core_threads()


def _large_pass(tensors: List[torch.Tensor]) -> bool:
    """Whether a pass over these tensors moves PARALLEL_PASS_BYTES or more: enough to share among threads."""
    return sum(t.numel() * t.element_size() for t in tensors) >= PARALLEL_PASS_BYTES


def _chunked(tensors: List[torch.Tensor]) -> bool:
    """Whether the weight pass over these tensors goes chunk by chunk (over WHOLE_PASS_BYTES), not list-wide
    over whole tensors."""
    return sum(t.numel() * t.element_size() for t in tensors) > WHOLE_PASS_BYTES


def _core_threads() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_PASS_THREADS))


def _write_beside_pass(tensors: List[torch.Tensor]) -> bool:
    """Whether the reference is written during the pass (write_tensor_file's `meanwhile`). On the CPU, when the
    pass goes chunk by chunk: each chunk of the weights is written while the pass has it in cache. From a GPU,
    for large models only, on a thread of its own (a thread costs less than the overlap saves there): the
    pass waits on copies to the device and the write on copies back and the page cache."""
    if any(t.device.type == "cpu" for t in tensors):
        return _chunked(tensors)
    return _large_pass(tensors)


def _split_evenly(chunks: List[tuple], parts: int) -> List[List[tuple]]:
    """(tensor, start, n) chunks cut into `parts` runs of consecutive chunks with about equal elements."""
    total = sum(n for *_, n in chunks)
    out: List[List[tuple]] = [[] for _ in range(max(parts, 1))]
    done = 0
    for chunk in chunks:
        out[min(done * len(out) // max(total, 1), len(out) - 1)].append(chunk)
        done += chunk[-1]
    return [part for part in out if part] or [[]]


def _replace_keeping_old(new: str, path: str, spare: str) -> None:
    previous = path + ".prev"
    if os.path.lexists(previous):
        os.remove(previous)
    os.link(path, previous)  # keeps the old inode alive: `path` itself is never missing or half-written
    os.replace(new, path)
    os.replace(previous, spare)


def _host_chunks(t: torch.Tensor):
    """The bytes of a tensor as memoryviews: zero-copy for CPU tensors, CHUNK_BYTES at a time from a GPU.

    From a CUDA device the chunks go through two pinned buffers in turn: the copy of the next chunk runs while
    the caller writes this one, and no pageable copy is staged twice. A chunk is handed out only once its copy
    has finished, and its buffer is refilled only when the caller asks for the chunk after next."""
    if t.numel() == 0:
        return
    if t.device.type == "cpu":
        t = t.contiguous()
        yield _bytes_of(t)
        return
    flat = t.reshape(-1)
    spans = chunk_spans([flat])
    if t.device.type != "cuda":
        for _, start, n in spans:
            yield _bytes_of(flat[start:start + n].to("cpu"))
        return
    # Pinned blocks come from torch's caching host allocator: after the first collection no new pinning.
    buffers = [torch.empty(spans[0][2], dtype=flat.dtype, pin_memory=True) for _ in range(min(2, len(spans)))]
    done = [torch.cuda.Event() for _ in buffers]

    def fetch(k):
        _, start, n = spans[k]
        buffers[k % 2][:n].copy_(flat[start:start + n], non_blocking=True)
        done[k % 2].record()

    fetch(0)
    for k, (_, _, n) in enumerate(spans):
        if k + 1 < len(spans):
            fetch(k + 1)
        done[k % 2].synchronize()
        yield _bytes_of(buffers[k % 2][:n])


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory as bytes, without a copy."""
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr()))


def chunk_spans(flats: List[torch.Tensor]) -> List[tuple]:
    """(tensor index, start element, elements) of every piece of at most CHUNK_BYTES, tensor by tensor, in order."""
    spans = []
    for i, flat in enumerate(flats):
        per_chunk = max(CHUNK_BYTES // flat.element_size(), 1)
        spans += [(i, start, min(per_chunk, flat.numel() - start)) for start in range(0, flat.numel(), per_chunk)]
    return spans


def tensor_file_info(path: str) -> tuple:
    """(header name -> {dtype, shape, data_offsets}, byte offset of the data section, __metadata__ dict).

    Checked against the file's real size before anything is allocated or mapped: a header length within
    the file (and MAX_HEADER_BYTES), known dtypes, sizes equal to dtype x shape, and tensor data that fills
    the rest of the file exactly, contiguous and without overlaps. Anything else, a truncated file (what a
    power cut can leave) included, is a ValueError that names the file.
    """
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{path}: {size} bytes, too short for a header")
        n = int.from_bytes(f.read(8), "little")
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(f"{path}: a header of {n} bytes in a file of {size}")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{path}: the header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: __metadata__ is not an object")
    end = 0
    for begin, stop, name in sorted(_tensor_span(path, name, meta) for name, meta in header.items()):
        if begin != end:
            raise ValueError(f"{path}: tensor {name!r} starts at {begin}, expected {end} (overlap or gap)")
        end = stop
    if 8 + n + end != size:
        raise ValueError(f"{path}: the tensors end at byte {8 + n + end} of {size} (truncated or damaged)")
    return header, 8 + n, metadata


def _tensor_span(path: str, name: str, meta: Any) -> tuple:
    try:
        begin, end = meta["data_offsets"]
        shape = meta["shape"]
        itemsize = _CODE_DTYPES[meta["dtype"]].itemsize
        ok = (all(type(v) is int and v >= 0 for v in (begin, end, *shape)) and isinstance(shape, list)
              and end - begin == math.prod(shape) * itemsize)
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{path}: the entry of tensor {name!r} is damaged")
    return begin, end, name


def read_tensor_header(path: str) -> tuple:
    """(header dict name -> {dtype, shape, data_offsets}, byte offset of the data section)."""
    return tensor_file_info(path)[:2]


def stream_tensor_file(path: str, names: List[str], mapper: Optional[Callable[[str, List[str]], tuple]] = None):
    """Yield each named tensor of a safetensors file, in order, read through a map (see map_tensor_file):
    a tensor's pages are handed back once the next is asked for, so the file never sits in RSS whole.
    `mapper(path, names)` maps the file as map_tensor_file does (the default), or through a kept map."""
    views, release = (mapper or map_tensor_file)(path, names)
    for i, view in enumerate(views):
        yield view
        release(i, 0, view.numel())


def reference_matches(path: str, named: List[tuple]) -> bool:
    """True when the file is sound and holds exactly these names with these shapes and dtypes."""
    try:
        header, _ = read_tensor_header(path)
    except (OSError, ValueError):
        return False
    return header_matches(header, named)


def header_matches(header: Dict[str, Any], named: List[tuple]) -> bool:
    return len(header) == len(named) and all(header_holds(header, n, t) for n, t in named)


def header_holds(header: Dict[str, Any], name: str, t: torch.Tensor) -> bool:
    """Whether the file's header has a tensor `name` of t's shape and dtype."""
    meta = header.get(name)
    return meta is not None and meta["shape"] == list(t.shape) and meta["dtype"] == _DTYPE_CODES.get(t.dtype)


def map_tensor_file(path: str, names: List[str], info: Optional[tuple] = None) -> tuple:
    """([tensor per name], release) over a private memory map of a safetensors file.

    Nothing is copied: a pass over the reference reads it once, straight from the page cache, where
    read() would copy it into a buffer first.
    The pages a pass touches count in the process's RSS until release(i, start, n) hands back those of
    tensor i's elements [start, start + n), so a chunked pass adds about a chunk to RSS, not the file.
    The map is private: a stray write would change this process's copy, never the file. A file shorter
    than its header says is refused (tensor_file_info), since reading past the end of a map kills the process.
    """
    # Checked against the file's size (here, or by the caller as `info`): no read past the map's end.
    header, base = (info or tensor_file_info(path))[:2]
    metas = [header[n] for n in names]
    with open_regular(path) as f:
        try:
            mapped: Any = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError):  # a filesystem that cannot map: read it whole, correct but not lean
            mapped = bytearray(f.read())
    releasable = _CAN_RELEASE_PAGES and not isinstance(mapped, bytearray)
    views, offsets, itemsizes = [], [], []
    for meta in metas:
        dtype = _CODE_DTYPES[meta["dtype"]]
        begin, end = meta["data_offsets"]
        itemsize = dtype.itemsize
        flat = (torch.frombuffer(mapped, dtype=dtype, count=(end - begin) // itemsize, offset=base + begin)
                if end > begin else torch.empty(0, dtype=dtype))
        views.append(flat.view(meta["shape"]))
        offsets.append(base + begin)
        itemsizes.append(itemsize)

    # Releases are gathered per thread until they span CHUNK_BYTES: a madvise per small tensor costs a
    # small model a large share of its pass. Each thread releases
    # its own consecutive run of the file; what is left when the pass ends goes with the map.
    unreleased = threading.local()

    def release(i: int, start: int, n: int) -> None:
        if n <= 0 or not releasable:
            return
        begin = offsets[i] + start * itemsizes[i]
        first = getattr(unreleased, "first", None)
        if first is None or first > begin:
            first = unreleased.first = begin // mmap.PAGESIZE * mmap.PAGESIZE
        end = begin + n * itemsizes[i]
        if end - first >= CHUNK_BYTES:
            mapped.madvise(mmap.MADV_DONTNEED, first, end - first)
            unreleased.first = None

    return views, release


def stream_tensor_chunks(path: str, names: List[str]):
    """Yield (tensor index, start element, flat chunk of at most CHUNK_BYTES) over the named tensors of a
    safetensors file, in order. Each chunk's pages are handed back when the next is asked for."""
    views, release = map_tensor_file(path, names)
    flats = [view.view(-1) for view in views]
    for i, start, n in chunk_spans(flats):
        yield i, start, flats[i][start:start + n]
        release(i, start, n)


def _negatives(signs: torch.Tensor) -> torch.Tensor:
    # #(x == -1) for x in {-1, 0, 1}: (sum x^2 - sum x) / 2; float32 sums of +-1 are exact below 2^24.
    if signs.numel() > 1 << 24:
        return (signs < 0).sum()
    return (torch.dot(signs, signs) - signs.sum()).div(2).round()


class _Scratch:
    """Reused buffers, one per (slot, device, dtype), grown as needed: a pass allocates a few chunks in all."""

    def __init__(self):
        self.buffers: Dict[Any, torch.Tensor] = {}

    def get(self, slot: str, dev: torch.device, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        buf = self.buffers.get((slot, dev, dtype))
        if buf is None or buf.numel() < n:
            buf = self.buffers[(slot, dev, dtype)] = torch.empty(n, dtype=dtype, device=dev)
        return buf[:n]

    def as_float(self, x: torch.Tensor, slot: str, dev: torch.device) -> torch.Tensor:
        """x in its _work_dtype on dev, copied (and converted) only when it is not already."""
        work = _work_dtype(x.dtype)
        if x.dtype == work and x.device == dev:
            return x
        return self.get(slot, dev, x.numel(), work).copy_(x)


def _change_sums(w: torch.Tensor, r: torch.Tensor, w0: torch.Tensor) -> torch.Tensor:
    """[sum (w - r)^2, sum (w - w0)^2, sum w^2] in float32: the body of the fused kernel."""
    w, r, w0 = w.float(), r.float(), w0.float()
    d, d0 = w - r, w - w0
    return torch.stack([(d * d).sum(), (d0 * d0).sum(), (w * w).sum()])


def _change_details(w: torch.Tensor, r: torch.Tensor, w0: torch.Tensor, thresholds: torch.Tensor,
                    rel_thresholds: torch.Tensor) -> tuple:
    """_change_sums, then for d = w - r what _ChangePass._details counts: sum d, sum |d|, max |d|,
    #(sign w * sign r < 0), #(|d| <= t) per threshold, #(|d| <= t * |r|) per relative threshold."""
    sums = _change_sums(w, r, w0)
    w, r = w.float(), r.float()
    d = w - r
    a = d.abs()
    return (sums, d.sum(), a.sum(), a.amax(), ((w.sign() * r.sign()) < 0).sum(),
            (a[None, :] <= thresholds[:, None]).sum(1),
            (a[None, :] <= r.abs()[None, :] * rel_thresholds[:, None]).sum(1))


class _FusedKernels:
    """The streamed pass's reductions over weights in CPU memory, compiled by torch.compile into one C++ loop
    per chunk: each chunk of the weights and of both files is read once and no difference is written out,
    where eager torch writes each difference and reads it back. (On a GPU the device's passes cost little
    beside the host's calls; see _block_pass.)

    Only with TELEMETRY_COMPILE=1 in the environment. Compiled once per process, at the end of the first
    collection that asks for a kernel, which waits for it (seconds to tens of seconds): never on a thread
    beside the training, since torch's tracer patches nn.Module.__call__ process-wide while it traces, and
    a forward that the loop runs meanwhile then fails inside the tracer; and torch.compile puts the global
    RNG state back as it found it, which would replay the loop's draws made meanwhile. Until a kernel is
    ready the eager ops serve, and a compile that fails leaves them in place for good (the failure is kept
    for one warning).
    The kernels are compiled ahead of time (aot_compile): a call never compiles, and an input they were not
    compiled for fails their guards and goes to the eager ops. So neither dynamo's frame hook nor its
    compile lock is involved when a pass calls them, whatever the user's own torch.compile does. A forked
    child keeps the kernels that were ready.
    """

    def __init__(self):
        self.kernels: Dict[tuple, Any] = {}  # key -> the compiled callable, or the message of its failure
        self.wanted: List[tuple] = []
        self.busy = threading.Lock()  # held while compiling; a pass calls kernels only when it is free
        self.compiling = False
        self.pid = os.getpid()

    @staticmethod
    def key(w: torch.Tensor, detail: bool, thresholds: int, rel_thresholds: int) -> tuple:
        return str(w.device), w.dtype, detail, thresholds, rel_thresholds

    def ready(self, key: tuple) -> Optional[Callable]:
        """The compiled kernel for `key`, or None (then it is compiled after this collection, if it can be)."""
        self._adopt_fork()
        kernel = self.kernels.get(key)
        if kernel is None and key not in self.wanted and os.environ.get("TELEMETRY_COMPILE") == "1":
            self.wanted.append(key)
        return kernel if callable(kernel) else None

    def failure(self) -> Optional[str]:
        """Why a kernel could not be compiled, if one could not."""
        return next((kernel for kernel in self.kernels.values() if isinstance(kernel, str)), None)

    def start(self) -> None:
        """Compile what passes asked for, now: on the caller's thread, at the end of a collection."""
        self._adopt_fork()
        if not self.wanted or self.compiling:
            return
        self.compiling = True
        self._compile_wanted()

    @contextlib.contextmanager
    def free(self):
        """True inside when no compile is running, so that a pass may call the kernels."""
        if not self.busy.acquire(blocking=False):
            yield False
            return
        try:
            yield True
        finally:
            self.busy.release()

    def _compile_wanted(self) -> None:
        with self.busy, _rng_kept():  # whatever the compiler draws leaves no trace in the loop's generators
            while self.wanted:
                key = self.wanted[0]
                try:
                    self.kernels[key] = _compile_change_kernel(*key)
                except Exception as exc:  # no compiler, an unsupported device or Python: eager for good
                    self.kernels[key] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
                self.wanted.pop(0)
            self.compiling = False

    def _adopt_fork(self) -> None:
        if self.pid == os.getpid():
            return
        self.pid, self.busy = os.getpid(), threading.Lock()
        if self.compiling:  # forked by another thread during a compile: the compiling one is not in this process
            for key in self.wanted:
                self.kernels[key] = "the process forked while the kernel was compiled"
            self.compiling = False
        self.wanted = []


def _compile_change_kernel(device: str, dtype: torch.dtype, detail: bool, thresholds: int,
                           rel_thresholds: int) -> Callable:
    """The fused kernel for chunks of this device and dtype, compiled now (seconds) by a first call on
    chunk-sized inputs and checked against the eager body. Lengths are dynamic, so one kernel serves every
    chunk of FUSED_MIN_ELEMENTS or more; on the CPU it is single-threaded, as the pass runs one per thread."""
    # cpp_wrapper: the compiled call runs in C++ without the GIL, so the pass's threads compute side by side.
    options = {"cpp.threads": 1, "compile_threads": 1, "cpp_wrapper": True} if device.startswith("cpu") else {}
    body = _change_details if detail else _change_sums
    n = max(CHUNK_BYTES // dtype.itemsize, FUSED_MIN_ELEMENTS)
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(n, generator=gen).to(device, dtype) for _ in range(3)]
    if detail:
        args += [torch.linspace(0, 1, thresholds).to(device), torch.linspace(0, 1, rel_thresholds).to(device)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # this thread's count, which the kernel guards on: a pass calls it on one
    try:
        with torch.no_grad():
            # Compiled ahead of its calls: a call checks the guards and raises on a mismatch, where the
            # plain compiled function would compile again, inside a collection.
            kernel = torch.compile(body, dynamic=True, fullgraph=True, options=options).aot_compile((tuple(args), {}))
            got, want = kernel(*args), body(*args)
    finally:
        torch.set_num_threads(threads)
    got, want = (got, want) if detail else ((got,), (want,))
    if not all(torch.allclose(g.double(), e.double(), rtol=1e-4) for g, e in zip(got, want)):
        raise RuntimeError("the compiled kernel disagrees with the eager ops")
    return kernel


_FUSED = _FusedKernels()


@dataclass
class _ChangePass:
    """The sums of one streamed pass over the weights, their reference and their initial values (see
    streamed_weight_changes): over whole tensors with list-wide ops, or chunk by chunk, where accumulate()
    may run on several threads, each over its own chunks, through the fused kernels where they are ready."""
    flats: List[torch.Tensor]
    refs: Optional[List[torch.Tensor]]
    release_ref: Optional[Callable]
    inits: Optional[List[torch.Tensor]]
    release_init: Optional[Callable]
    detail: bool
    thresholds: List[float]
    rel_thresholds: List[float]
    wide: torch.dtype  # float64, or float32 on mps
    kernels: List[Optional[Callable]] = dataclasses.field(default_factory=list)  # per tensor; empty: eager
    limits: Optional[tuple] = None  # (thresholds, rel_thresholds) as float32 tensors, for the kernels
    put: Optional[Callable] = None  # put(i, start, values): each chunk of the weights once it is summed

    def zeros(self, only: Optional[List[int]] = None) -> Dict[str, List[torch.Tensor]]:
        """Accumulators per tensor (for the tensors `only` names, None for the others)."""
        wanted = set(range(len(self.flats)) if only is None else only)

        def each(dtype, *shape):
            return [torch.zeros(shape, dtype=dtype, device=w.device) if i in wanted else None
                    for i, w in enumerate(self.flats)]
        keys = (["weight_sq"] + (["delta_sq"] if self.refs is not None else [])
                + (["drift_sq"] if self.inits is not None else []))
        acc = {k: each(self.wide) for k in keys}
        if self.detail:
            acc.update(l1=each(self.wide), sum=each(self.wide), max_abs=each(self.wide), flips=each(torch.int64),
                       below=each(torch.int64, len(self.thresholds)),
                       below_rel=each(torch.int64, len(self.rel_thresholds)))
        return acc

    @torch.no_grad()  # per thread (grad mode is thread-local): the kernels were compiled without autograd
    def accumulate(self, part: List[tuple]) -> Dict[str, List[torch.Tensor]]:
        """The sums over the chunks (tensor index, start, elements) of `part`, with scratch buffers of its own."""
        if any(self.kernels) and torch.get_num_threads() != 1:
            torch.set_num_threads(1)  # a new thread's own count: the kernels were compiled (and guard) for one
        acc, scratch = self.zeros(), _Scratch()
        for i, start, n in part:
            if not (self.kernels and self.kernels[i] is not None and n >= FUSED_MIN_ELEMENTS
                    and self._fused(acc, i, start, n)):
                self._eager(acc, scratch, i, start, n)
            if self.put is not None:
                self.put(i, start, self.flats[i][start:start + n])
        return acc

    def _eager(self, acc, scratch: _Scratch, i: int, start: int, n: int) -> None:
        """A chunk's sums through eager torch ops, into reused scratch buffers."""
        dev = self.flats[i].device
        wc = scratch.as_float(self.flats[i][start:start + n], "w", dev)
        acc["weight_sq"][i] += torch.dot(wc, wc)
        if self.refs is not None:
            rc = scratch.as_float(self.refs[i].view(-1)[start:start + n], "r", dev)
            d = torch.sub(wc, rc, out=scratch.get("d", dev, n, wc.dtype))
            acc["delta_sq"][i] += torch.dot(d, d)
            if self.detail:
                self._details(acc, i, wc, rc, d, scratch)
            self.release_ref(i, start, n)
        if self.inits is not None:
            r0 = scratch.as_float(self.inits[i].view(-1)[start:start + n], "r0", dev)
            d0 = torch.sub(wc, r0, out=scratch.get("d", dev, n, wc.dtype))
            acc["drift_sq"][i] += torch.dot(d0, d0)
            self.release_init(i, start, n)

    def _fused(self, acc, i: int, start: int, n: int) -> bool:
        """Add a chunk's sums through the fused kernel; False (nothing added) when its guards refuse the
        inputs, and the eager ops then serve this tensor. Only with both files: one tensor passed for two
        inputs is not what the kernel was compiled for."""
        w = self.flats[i][start:start + n]
        r, r0 = self.refs[i].view(-1)[start:start + n], self.inits[i].view(-1)[start:start + n]
        try:
            out = self.kernels[i](w, r, r0, *self.limits) if self.detail else (self.kernels[i](w, r, r0),)
        except RuntimeError:  # a guard failed (another stride, dtype or state): nothing was computed
            self.kernels[i] = None
            return False
        for k, key in enumerate(("delta_sq", "drift_sq", "weight_sq")):
            acc[key][i] += out[0][k]
        if self.detail:
            for key, value in zip(("sum", "l1"), out[1:3]):
                acc[key][i] += value
            acc["max_abs"][i] = torch.maximum(acc["max_abs"][i], out[3].to(self.wide))
            for key, value in zip(("flips", "below", "below_rel"), out[4:]):
                acc[key][i] += value
        self.release_ref(i, start, n)
        self.release_init(i, start, n)
        return True

    def whole(self) -> Dict[str, torch.Tensor]:
        """The same sums over whole tensors, with one list-wide (torch._foreach_*) op per quantity rather than
        several ops per chunk: for small models, whose fixed cost per op dominates. The differences of the
        whole model are materialised, one at a time, which is why this is for small models only."""
        device = self.flats[0].device
        ws = _floats_on(self.flats, device)
        groups, rest = _same_shape_groups(ws)
        if groups:  # many small CPU tensors of a few shapes (LoRA's): a stack per shape, the rest list-wide
            return self._by_shape(ws, groups, rest)
        out = {"weight_sq": _squared_norms(ws)}
        if self.refs is not None:
            rs = _floats_on([r.view(-1) for r in self.refs], device)
            d = torch._foreach_sub(ws, rs)
            out["delta_sq"] = _squared_norms(d)
            if self.detail:
                out.update(self._details_of(ws, rs, [], list(range(len(ws))), d))
            del d, rs
        if self.inits is not None:
            out["drift_sq"] = _squared_norms(torch._foreach_sub(ws, _floats_on([r.view(-1) for r in self.inits],
                                                                             device)))
        return out

    def _by_shape(self, ws: List[torch.Tensor], groups: List[List[int]], rest: List[int]) -> Dict[str, torch.Tensor]:
        """whole()'s sums with each group of small tensors of one shape stacked, the rest list-wide."""
        out = {}
        for key, files in (("weight_sq", None), ("delta_sq", self.refs), ("drift_sq", self.inits)):
            if key != "weight_sq" and files is None:
                continue
            sq = torch.empty(len(ws), dtype=torch.float32)
            for members in groups:
                sq[members] = _stacked_sq_norms([ws[i] for i in members], None if files is None else
                                                [files[i].view(-1) for i in members], ws[members[0]].dtype)
            if rest:
                others = [ws[i] for i in rest]
                if files is not None:
                    others = torch._foreach_sub(others, _floats_on([files[i].view(-1) for i in rest], ws[0].device))
                sq[rest] = _squared_norms(others)
            out[key] = sq
        if self.detail:
            out.update(self._details_of(ws, _floats_on([r.view(-1) for r in self.refs], ws[0].device), groups, rest))
        return out

    def _details_of(self, ws: List[torch.Tensor], rs: List[torch.Tensor], groups: List[List[int]],
                    rest: List[int], diffs: Optional[List[torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
        """What _details counts, as vectors over the tensors: for each group of small CPU tensors of one shape
        from one stack of the weights and one of their references, for the rest tensor by tensor (with their
        differences `diffs`, where the caller has them)."""
        n, wide, device = len(ws), self.wide, ws[0].device
        out = {k: torch.zeros(n, dtype=wide, device=device) for k in ("sum", "l1", "max_abs")}
        out.update(flips=torch.zeros(n, dtype=torch.int64, device=device),
                   below=torch.zeros(n, len(self.thresholds), dtype=torch.int64, device=device),
                   below_rel=torch.zeros(n, len(self.rel_thresholds), dtype=torch.int64, device=device))
        for members in groups:
            w = torch.stack([ws[i] for i in members]).reshape(len(members), -1)
            if not w.shape[1]:
                continue   # empty tensors add nothing (and have no max)
            r = torch.stack([rs[i] for i in members]).reshape(len(members), -1)
            d = w - r
            a = d.abs()
            out["sum"][members], out["l1"][members] = d.sum(1, dtype=wide), a.sum(1, dtype=wide)
            out["max_abs"][members] = a.amax(1).to(wide)
            out["flips"][members] = (w.sign() * r.sign() < 0).sum(1)
            # #(|d| <= t) as the count of the others, as _details has it
            for k, t in enumerate(self.thresholds):
                out["below"][members, k] = w.shape[1] - (a > t).sum(1)
            ra = r.abs()
            for k, t in enumerate(self.rel_thresholds):
                out["below_rel"][members, k] = w.shape[1] - (a > ra * t).sum(1)
        if rest:
            acc, scratch = self.zeros(rest), _Scratch()
            for i in rest:
                if ws[i].numel():   # an empty shard adds nothing (and has no max)
                    self._details(acc, i, ws[i], rs[i], ws[i] - rs[i] if diffs is None else diffs[i], scratch)
            for key in _DETAIL_KEYS:
                out[key][rest] = torch.stack([acc[key][i].to(device) for i in rest])
        return out

    def combine(self, accs: List[Dict[str, List[torch.Tensor]]], device: torch.device) -> Dict[str, torch.Tensor]:
        """The parts' sums added up (max for max_abs), as vectors [tensors] on `device`."""
        acc = {k: [functools.reduce(torch.maximum if k == "max_abs" else torch.add, per_tensor)
                   for per_tensor in zip(*(a[k] for a in accs))] for k in accs[0]}
        out = {k: torch.stack([v.to(device) for v in values]) for k, values in acc.items()}
        for key in ("weight_sq", "delta_sq", "drift_sq"):
            if key in out:
                out[key] = out[key].float()
        return out

    def _details(self, acc, i: int, wc: torch.Tensor, rc: torch.Tensor, d: torch.Tensor, scratch: _Scratch) -> None:
        # Counts come from s = sign(x) in {-1, 0, 1}: #(s < 0) = (s.s - sum s) / 2, exact in float32 for a
        # chunk, and cheaper than a bool mask and its sum. sign(|d| - t) < 0 iff |d| < t.
        dev, n, wide, work = wc.device, wc.numel(), self.wide, wc.dtype
        acc["sum"][i] += d.sum().to(wide)
        a = torch.abs(d, out=scratch.get("a", dev, n, work))
        acc["l1"][i] += a.sum().to(wide)
        acc["max_abs"][i] = torch.maximum(acc["max_abs"][i], a.max().to(wide))
        s = torch.sign(wc, out=scratch.get("d", dev, n, work)).mul_(torch.sign(rc, out=scratch.get("s", dev, n, work)))
        acc["flips"][i] += _negatives(s).long()
        if self.thresholds:  # |d| <= t  <=>  not (t - |d| < 0)
            acc["below"][i] += n - torch.stack([
                _negatives(torch.sub(t, a, out=scratch.get("d", dev, n, work)).sign_()) for t in self.thresholds]).long()
        if self.rel_thresholds:
            ra = torch.abs(rc, out=scratch.get("s", dev, n, work))
            acc["below_rel"][i] += n - torch.stack([
                _negatives(torch.mul(ra, t, out=scratch.get("d", dev, n, work)).sub_(a).sign_())
                for t in self.rel_thresholds]).long()


_DETAIL_KEYS = ("l1", "sum", "max_abs", "flips", "below", "below_rel")


def _floats_on(tensors: List[torch.Tensor], device: torch.device) -> List[torch.Tensor]:
    """The tensors in their _work_dtype on `device`, converted only where they are not."""
    return [t if t.dtype == _work_dtype(t.dtype) and t.device == device else t.to(device, _work_dtype(t.dtype))
            for t in tensors]


def _squared_norms(tensors: List[torch.Tensor], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """||t||^2 of each tensor, list-wide, as float32 (the norms taken in `dtype`, if given)."""
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=dtype)).square().float() if tensors else torch.zeros(0)


def streamed_weight_changes(named: List[tuple], reference_path: Optional[str] = None,
                            initial_path: Optional[str] = None, thresholds: List[float] = (),
                            rel_thresholds: List[float] = (), detail: bool = False,
                            mapper: Optional[Callable[[str, List[str]], tuple]] = None,
                            fused: bool = True, put: Optional[Callable] = None) -> Dict[str, torch.Tensor]:
    """Every per-tensor quantity of the weight-change sections from ONE pass over the weights: the
    reference and the initial weights are streamed side by side in CHUNK_BYTES pieces, each file once,
    and each chunk of the weights is read once for all of them (into reused scratch buffers, so the extra
    memory is a few chunks whatever the model's size). In CPU memory, models of up to WHOLE_PASS_BYTES are
    taken whole, with list-wide ops, and larger ones go through the fused kernels (see _FusedKernels) once
    they are ready; weights on a device go block by block (see _block_pass).

    With w the current weights, r the reference (previous collection) and w0 the initial weights, for each
    tensor, as vectors [len(named)] on the first weight's device:
      weight_sq = ||w||^2;  delta_sq = ||w - r||^2 (with reference_path);  drift_sq = ||w - w0||^2 (with
      initial_path) -- float32;
    with detail and reference_path, for d = w - r:
      l1 = sum |d|, sum = sum d, max_abs = max |d| (float64; float32 on mps);
      flips = #(sign w * sign r < 0), below[k] = #(|d| <= thresholds[k]),
      below_rel[k] = #(|d| <= rel_thresholds[k] * |r|) (int64, [len(thresholds), tensors]).
    Without either file, weight_sq alone comes from per_tensor_sq_norms. `mapper(path, names)` maps a file
    as map_tensor_file does (the default; a caller may keep what it already checked or mapped); `fused=False`
    keeps to the eager ops. `put(i, start, values)` (write_tensor_file's, which gives one for CPU weights only)
    is handed each chunk of the weights once it is summed, when the pass goes chunk by chunk.
    """
    if not named:
        return {}
    device = named[0][1].device
    names = [n for n, _ in named]
    if reference_path is None and initial_path is None:
        return {"weight_sq": per_tensor_sq_norms([w.detach() for _, w in named], device)}
    flats = [w.detach().reshape(-1) for _, w in named]
    # Both files hold the same names, shapes and dtypes as the weights (reference_matches), so chunks line up.
    mapper = mapper or map_tensor_file
    refs, release_ref = mapper(reference_path, names) if reference_path else (None, None)
    inits, release_init = mapper(initial_path, names) if initial_path else (None, None)
    sums = _ChangePass(flats, refs, release_ref, inits, release_init, detail and reference_path is not None,
                       list(thresholds), list(rel_thresholds), _wide(device), put=put)
    if _blockwise(flats):
        out = _block_pass(sums, device)
    elif not _chunked(flats):
        out = sums.whole()
    else:
        out = _chunked_pass(sums, device, fused)
    for key in ("below", "below_rel"):
        if key in out:
            out[key] = out[key].T.contiguous()  # [thresholds, tensors]
    return out


def _chunked_pass(sums: _ChangePass, device: torch.device, fused: bool) -> Dict[str, torch.Tensor]:
    """sums of weights in CPU memory over CHUNK_BYTES pieces, split over _pass_threads threads, through the
    fused kernels that are ready."""
    parts = _split_evenly(chunk_spans(sums.flats), _pass_threads(sums.flats))
    with _FUSED.free() if fused else contextlib.nullcontext(False) as free, _one_cpu_thread():
        if free and not torch.compiler.is_compiling():
            _take_kernels(sums, device)
        return sums.combine(_concurrently(*[lambda part=part: sums.accumulate(part) for part in parts]), device)


def _block_pass(sums: _ChangePass, device: torch.device) -> Dict[str, torch.Tensor]:
    """The sums of weights on a device, block by block (DEVICE_BLOCK_BYTES): each block's pieces of each file
    are gathered by one host copy into a pinned buffer and sent over in one transfer, and the block is measured
    with whole()'s list-wide ops. On a GPU the pass waits on the host, not the device, so what counts is how
    few calls it makes: a block costs about as many as one tensor did chunk by chunk."""
    blocks = _device_blocks(sums.flats)
    if not blocks:  # every tensor empty (a rank's empty shards): whole() gives each key its zeros
        return sums.whole()
    totals: Dict[str, torch.Tensor] = {}
    for block in blocks:
        dev = sums.flats[block[0][0]].device
        part = _ChangePass([sums.flats[i][start:start + n] for i, start, n in block],
                           _staged(sums.refs, block, dev), None, _staged(sums.inits, block, dev), None,
                           sums.detail, sums.thresholds, sums.rel_thresholds, sums.wide).whole()
        for release in (sums.release_ref, sums.release_init):
            for i, start, n in block if release is not None else ():
                release(i, start, n)
        owners = _to_device(torch.tensor([i for i, _, _ in block]), device)  # no wait: the next block's copy goes on
        for key, values in part.items():
            values = values.to(device, sums.wide if values.is_floating_point() else values.dtype)
            if key not in totals:
                totals[key] = values.new_zeros((len(sums.flats),) + values.shape[1:])
            if key == "max_abs":
                totals[key].scatter_reduce_(0, owners, values, "amax")
            else:
                totals[key].index_add_(0, owners, values)
    for key in ("weight_sq", "delta_sq", "drift_sq"):
        if key in totals:
            totals[key] = totals[key].float()
    return totals


def _blockwise(flats: List[torch.Tensor]) -> bool:
    """Whether the pass over these weights goes block by block (_block_pass): when any is on a device."""
    return any(w.device.type != "cpu" for w in flats)


def _device_blocks(flats: List[torch.Tensor]) -> List[List[tuple]]:
    """(tensor index, start, elements) pieces of the tensors, in order, cut into blocks of at most
    DEVICE_BLOCK_BYTES whose pieces share a device and a dtype (a block is one buffer of the files)."""
    blocks: List[List[tuple]] = []
    size = 0
    for i, flat in enumerate(flats):
        per_block = max(DEVICE_BLOCK_BYTES // flat.element_size(), 1)
        for start in range(0, flat.numel(), per_block):
            n = min(per_block, flat.numel() - start)
            last = flats[blocks[-1][-1][0]] if blocks else None
            if last is None or (last.device, last.dtype) != (flat.device, flat.dtype) or \
                    size + n * flat.element_size() > DEVICE_BLOCK_BYTES:
                blocks.append([])
                size = 0
            blocks[-1].append((i, start, n))
            size += n * flat.element_size()
    return blocks


def _staged(files: Optional[List[torch.Tensor]], block: List[tuple], dev: torch.device) -> Optional[List[torch.Tensor]]:
    """A block's pieces of a file's tensors on `dev`, in their _work_dtype: copied by one call into one (pinned,
    for a CUDA device) buffer, which goes over in one transfer while the caller goes on; torch's caching host
    allocator hands the buffer out again only once that transfer has finished."""
    if files is None:
        return None
    pieces = [files[i].view(-1)[start:start + n] for i, start, n in block]
    host = torch.empty(sum(n for *_, n in block), dtype=pieces[0].dtype, pin_memory=dev.type == "cuda")
    torch.cat(pieces, out=host)
    moved = host.to(dev, non_blocking=True)
    return list(moved.to(_work_dtype(moved.dtype)).split([n for *_, n in block]))


def _take_kernels(sums: _ChangePass, device: torch.device) -> None:
    """Give the pass the fused kernel of each tensor on `device` that is ready (asking for the others)."""
    found: Dict[tuple, Optional[Callable]] = {}
    both = sums.refs is not None and sums.inits is not None  # else eager: a run's first collection, no drift
    for w in sums.flats:
        if w.device == device and w.dtype != torch.float64 and \
                min(w.numel(), CHUNK_BYTES // w.element_size()) >= FUSED_MIN_ELEMENTS:
            key = _FusedKernels.key(w, sums.detail, len(sums.thresholds), len(sums.rel_thresholds))
            found[key] = found[key] if key in found else _FUSED.ready(key)
            sums.kernels.append(found[key] if both else None)
        else:
            sums.kernels.append(None)
    if sums.detail:
        sums.limits = (torch.tensor(sums.thresholds, dtype=torch.float32, device=device),
                       torch.tensor(sums.rel_thresholds, dtype=torch.float32, device=device))


def _overwrite_weights(params: List[torch.Tensor], chunks: Any) -> None:
    """Write (tensor index, start element, values) chunks into the weights in place, in logical order.

    A non-contiguous weight (e.g. channels_last) is staged whole, then copied: its flat view is not its
    memory order. Call under torch.no_grad().
    """
    staged: Dict[int, torch.Tensor] = {}
    for i, start, values in chunks:
        p = params[i]
        if p.is_contiguous():
            p.detach().view(-1)[start:start + values.numel()].copy_(values)
            continue
        buf = staged.setdefault(i, torch.empty(p.numel(), dtype=p.dtype, device=p.device))
        buf[start:start + values.numel()].copy_(values)
        if start + values.numel() == p.numel():
            p.detach().copy_(buf.view(p.shape))
            del staged[i]


# =====================================================================================================
# Collaborators: small private pieces that each own one concern of TrainingTelemetry
# =====================================================================================================


# ---- the process: ranks, threads, RNG, memory ------------------------------------------------------


def _rank_and_world() -> tuple:
    """(rank, world size) of the default process group; before init_process_group, torchrun's RANK and
    WORLD_SIZE, so that only rank 0 writes run.json even when telemetry is made first."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), 1


def _parallelism(model: torch.nn.Module, params: List[torch.Tensor], world_size: int) -> str:
    """none, ddp, fsdp2 (DTensor parameters: fully_shard, also HSDP and TP), deepspeed (ZeRO's parameter
    attributes) or fsdp1 (FullyShardedDataParallel, unsupported)."""
    if world_size == 1:
        return "none"
    if any(is_sharded(p) for p in params):
        return "fsdp2"
    if any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in params):
        return "deepspeed"
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        return "fsdp1"
    return "ddp"


def _reduce_device() -> torch.device:
    # gloo reduces host tensors; nccl and the other accelerator backends reduce on the current device.
    if torch.distributed.get_backend() == "gloo" or not torch.accelerator.is_available():
        return torch.device("cpu")
    return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())


def _unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The same parameters, under the names a single process of the plain model would record: without DDP's
    and DataParallel's "module." and torch.compile's "_orig_mod." (a run resumed with torch.compile added is
    the same run, and compiled and eager runs compare group by group and layer by layer)."""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None),
                                                                       torch.nn.Module):
            model = model._orig_mod
        else:
            return model


@contextlib.contextmanager
def _one_cpu_thread():
    """Run a collection on one intra-op thread, then give the training loop its threads back.

    A collection is many small memory-bound ops. With every core busy (dataloader workers, other jobs),
    each multi-threaded op waits out a scheduler slice, many times the op's own cost.
    One thread runs them near memory bandwidth either way; GPU work is unaffected.
    """
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


_HOOK_ORDER = "the arguments are (model, optimizer, batch_idx, epoch, device=None, batch=None, loss=None, **scalars)"


def _hook_loss(loss: Any) -> Any:
    """loss= as it is recorded: a number, or a one-element tensor (read with the record); a one-element numpy
    array as its number. Anything else is refused at the call: a loss that is no number would be left out
    of every loss check without a word."""
    if type(loss).__module__ == "numpy" and getattr(loss, "size", None) == 1:
        return loss.item()
    if isinstance(loss, torch.Tensor) and loss.numel() != 1:
        raise ValueError(f"on_batch_end: loss= has {loss.numel()} values (shape {list(loss.shape)}); pass the "
                         "one number the optimizer stepped on, e.g. loss.mean() for a per-example loss")
    if loss is not None and not isinstance(loss, (torch.Tensor, numbers.Real)) or isinstance(loss, bool):
        raise TypeError(f"on_batch_end: loss= got a {type(loss).__name__}; pass the loss the optimizer stepped on, "
                        "as its tensor or a number (loss.item())")
    return loss


def _check_device_index(index: int, model: torch.nn.Module) -> None:
    """device= given as a number names an accelerator by its index; refused unless the model is on that one.
    A loop that passes its step, batch or epoch counter in that place (the hook read as (model, optimizer,
    step, batch_idx, epoch)) would otherwise send the holdout to a device the model is not on, or to none."""
    where = next((p.device for p in model.parameters()), None)
    if where is None or (where.type != "cpu" and where.index == index):
        return
    raise ValueError(f"on_batch_end: device={index} names accelerator {index}, but the model is on {where}; "
                     f"{_HOOK_ORDER}: pass a step count as batch_idx, and the model's device (or nothing) as device")


def _rng_state() -> Dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")  # None where a program blocked its import
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


@contextlib.contextmanager
def _rng_kept():
    """Whatever runs inside may draw random numbers (dropout, a user's metric): the torch, CUDA, Python and
    NumPy generators are put back as they were, so the training draws exactly what it would have."""
    rng = _rng_state()
    try:
        yield
    finally:
        _set_rng_state(rng)


def _rss_mb() -> Optional[float]:
    """Resident set size of this process in MiB: /proc/self/statm on Linux, else psutil when installed."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil  # optional, lazy
        return psutil.Process().memory_info().rss / 2**20
    except Exception:
        return None


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _raise(exc: BaseException) -> None:
    raise exc


class _Warnings:
    """Each telemetry warning once per run: a metric that fails at every collection warns at the first."""

    def __init__(self):
        self.seen: set = set()

    def __call__(self, key: str, message: str) -> None:
        if key not in self.seen:
            self.seen.add(key)
            try:
                warnings.warn(message, RuntimeWarning, stacklevel=4)
            except Warning:  # python -W error: the loop must not see it; it still reaches the log
                _LOGGER.warning(message)


class _Mirrors:
    """Each record's numbers also sent to wandb (the active run) and/or TensorBoard (output_dir/tb).

    A failing mirror lands in the record's errors (mirror_<name>), is warned about once, and never stops the
    JSONL line; a mirror whose package is missing is not tried again.
    """

    def __init__(self, config: TelemetryConfig, warn: _Warnings, output_dir: str):
        self.names = list(config.mirror)
        self.tb_dir = os.path.join(output_dir, "tb")
        self.strict = config.strict
        self.warn = warn
        self.off: set = set()
        self.wandb_run: Any = None
        self.tb: Any = None
        self.classes: Dict[str, None] = {}  # every batch class seen so far, in order: sent at 0 when absent

    def send(self, record: Dict[str, Any]) -> None:
        flat = None
        for name in self.names:
            if name in self.off:
                continue
            try:
                if flat is None:
                    self.classes.update(dict.fromkeys(batch_shares(record.get("batch_stats"))))
                    flat = flatten_scalars(record, classes=self.classes)
                (self._wandb if name == "wandb" else self._tensorboard)(flat, record["step"])
            except Exception as exc:
                if self.strict:
                    raise
                if isinstance(exc, ImportError):  # not installed: stop trying
                    self.off.add(name)
                message = f"{type(exc).__name__}: {exc}"
                record.setdefault("errors", {})[f"mirror_{name}"] = message
                self.warn(f"mirror:{name}", f"telemetry: the {name} mirror failed ({message}); "
                                            "telemetry.jsonl is unaffected")

    def _wandb(self, flat: Dict[str, float], step: int) -> None:
        import wandb  # lazy: only with mirror: [wandb]

        run = wandb.run
        if run is None:
            self.warn("wandb-run", "telemetry: mirror wandb: no active run (call wandb.init() first); "
                                   "records are not mirrored until there is one")
            return
        if run is not self.wandb_run:
            # Our own x axis: logging with step= would fight other loggers' steps (wandb drops older ones).
            run.define_metric("telemetry/step")
            run.define_metric("telemetry/*", step_metric="telemetry/step")
            self.wandb_run = run
        run.log({**flat, "telemetry/step": step})

    def _tensorboard(self, flat: Dict[str, float], step: int) -> None:
        if self.tb is None:
            from torch.utils.tensorboard import SummaryWriter  # lazy: needs the tensorboard package

            self.tb = SummaryWriter(self.tb_dir)
        for key, value in flat.items():
            self.tb.add_scalar(key, value, global_step=step)
        self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None


class _Optimizers:
    """Several optimizers passed together (a backbone's and a head's, a GAN's two): their param groups side
    by side, in the order given, and a step is a call after which any of them stepped."""

    def __init__(self, members: tuple):
        self.members = members

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return [g for o in self.members for g in o.param_groups]


def _one_optimizer(optimizer: Any, kept: Dict[tuple, _Optimizers]) -> Any:
    """The optimizer argument as one object: a list or tuple of optimizers becomes an _Optimizers, the same
    one for the same members at every call (the layout and the step count are keyed by it). Anything without
    param_groups is refused: a learning-rate scheduler in its place would read as one group at lr 0."""
    members = tuple(optimizer) if isinstance(optimizer, (list, tuple)) else (optimizer,)
    bad = [one for one in members if one is not None and not hasattr(one, "param_groups")]
    if not members or bad:
        scheduler = next((one for one in bad if hasattr(getattr(one, "optimizer", None), "param_groups")), None)
        raise TypeError(f"optimizer= got a {type(scheduler).__name__}, a learning-rate scheduler: pass its optimizer "
                        "(the one its .optimizer holds)" if scheduler is not None else
                        "optimizer= takes an optimizer, or a list of optimizers that together hold the model's "
                        f"trainable parameters; got a {type(optimizer).__name__}"
                        + (f" of {', '.join(type(one).__name__ for one in bad) or 'nothing'}"
                           if isinstance(optimizer, (list, tuple)) else ""))
    if not isinstance(optimizer, (list, tuple)):
        return optimizer
    key = tuple(id(o) for o in members)
    if key not in kept:
        kept[key] = _Optimizers(members)
    return kept[key]


class _GradScaler:
    """What a torch.amp.GradScaler tells about the gradients: the scale they still carry, and the steps it
    skipped (update() backs the scale off exactly when it skipped one for inf/NaN gradients)."""

    def __init__(self):
        self.scaler: Any = None
        self.seen: Any = None  # the scale at the previous call, on the device
        self.skipped: Any = 0
        self.skipped_now = False  # scaler.step() skipped the step this call follows

    def set(self, scaler: Any) -> None:
        if scaler is not None and not scaler.is_enabled():  # GradScaler(enabled=use_amp) without AMP: nothing to read
            scaler = None
        self.scaler = scaler
        current = scaler._get_scale_async() if scaler is not None else None  # None before the first scale()
        self.seen = current.clone() if current is not None else getattr(scaler, "_init_scale", None)
        self.skipped = 0

    @property
    def active(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def track(self) -> None:
        """Count the back-offs since the previous call, with tensor ops: no call waits for the GPU."""
        if self.scaler is None:
            return
        scale = self.scaler._get_scale_async()
        if scale is None:
            return
        if self.seen is not None:
            self.skipped = self.skipped + (scale < self.seen).long()
        self.seen = scale.clone()

    def backed_off(self) -> bool:
        """Whether update() backed the scale off since the previous call, i.e. scaler.step() skipped the
        optimizer step for inf/NaN gradients: still a step of the loop, to record. One host sync, asked only
        on calls that saw no optimizer step."""
        scale = self.scaler._get_scale_async() if self.scaler is not None else None
        return scale is not None and self.seen is not None and bool(scale < self.seen)

    def scale_of(self, optimizer: Any, pre_step: bool) -> Optional[torch.Tensor]:
        """The factor the gradients are still multiplied by, or None.

        torch.amp.GradScaler keeps a stage per optimizer until update(): UNSCALED after scaler.unscale_,
        STEPPED after scaler.step(), which unscales in place first (fused optimizers write the unscaled
        gradients back too): both read as unscaled. READY, or no entry, means neither ran yet: scaled. But
        update() clears the entries, so a missing entry in on_batch_end (after the step, by contract) reads
        as unscaled, and in capture_gradients (before the step, by contract) as scaled.
        """
        if not self.active or optimizer is None:
            return None
        member = optimizer.members[0] if isinstance(optimizer, _Optimizers) else optimizer  # one scaler: one stage
        state = self.scaler._per_optimizer_states.get(id(member))  # .get: a defaultdict would add an entry
        stage = getattr(state["stage"], "name", None) if state else None
        if stage in ("UNSCALED", "STEPPED") or (stage is None and not pre_step):
            return None
        return self.scaler._get_scale_async()  # None before the first scaler.scale(): nothing is scaled

    def section(self) -> Dict[str, Any]:
        scale = self.scaler._get_scale_async()
        out = {"scale": scale if scale is not None else self.scaler.get_scale(), "skipped_steps": self.skipped}
        if self.skipped_now:  # the gradients of this record hold the inf/NaN the scaler skipped the step for
            out["skipped"] = True
        return out


class _SystemClock:
    """The `system` section: wall time and throughput since the previous collection, memory, GPU use."""

    def __init__(self):
        self.last: Optional[tuple] = None  # (perf_counter, step) at the previous collection
        self.last_ms = 0.0  # the previous collection's telemetry_ms
        self.accumulation = 1  # micro-batches an optimizer step that the hook is not called for (the Trainer's)
        self.no_gpu_util = False

    def section(self, model: torch.nn.Module, batch: Any, started: float, step: int,
                batches_per_step: int = 1) -> Dict[str, Any]:
        """Throughput assumes the batches since the previous collection were the size of this one, and that an
        optimizer step took `batches_per_step` of them (times `accumulation`): gradient accumulation.
        telemetry_share is the previous collection's own time over the wall time since it started.
        cuda_peak_mb is the peak since the process started (resetting the counter is the user's to do)."""
        out: Dict[str, Any] = {}
        last, self.last = self.last, (started, step)
        if last is not None and step > last[1] and started > last[0]:
            elapsed, steps = started - last[0], step - last[1]
            out["step_time_s"] = elapsed / steps
            if batch is not None:
                out.update(_throughput(batch, steps * batches_per_step * self.accumulation / elapsed))
            out["telemetry_share"] = self.last_ms / 1e3 / elapsed
        rss = _rss_mb()
        if rss is not None:
            out["rss_mb"] = rss
        device = next((p.device for p in model.parameters()), None)
        if device is not None and device.type == "cuda":
            out.update(self._cuda(device))
        return out

    def _cuda(self, device: torch.device) -> Dict[str, Any]:
        out = {"cuda_allocated_mb": torch.cuda.memory_allocated(device) / 2**20,
               "cuda_reserved_mb": torch.cuda.memory_reserved(device) / 2**20,
               "cuda_peak_mb": torch.cuda.max_memory_allocated(device) / 2**20}
        if not self.no_gpu_util:
            try:
                out["gpu_util_pct"] = float(torch.cuda.utilization(device))  # imports pynvml lazily
            except Exception:  # no nvidia-ml-py, or no NVML: the key is absent
                self.no_gpu_util = True
        return out


def _throughput(batch: Any, steps_per_s: float) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    try:
        out["examples_per_s"] = batch_size_of(batch) * steps_per_s
    except TypeError:
        pass
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    if isinstance(ids, torch.Tensor):
        text = text_positions(batch.get("attention_mask"), ids.shape)
        tokens = text.sum() if text is not None else ids.numel()
        out["tokens_per_s"] = tokens * steps_per_s
    return out


class _AlertMonitor:
    """Online alerts: each condition is reported in the record where it starts, once while it holds.

    State is O(1): two fixed-size windows (loss, gradient norm) and one streak counter per group.
    """

    def __init__(self, config: TelemetryConfig):
        self.config = config
        self.history = {k: collections.deque(maxlen=config.alert_window) for k in ("loss", "grad")}
        self.first_losses: List[float] = []  # the run's scale: a spike must be visible on it
        self.active: set = set()
        self.frozen_streak: Dict[tuple, int] = {}
        self.collections = 0
        self.pending: List[Dict[str, Any]] = []  # new alerts not yet handed to on_alert

    def check(self, record: Dict[str, Any], nonfinite: bool = True) -> Optional[List[Dict[str, Any]]]:
        """The alerts whose condition starts in this host record (the `alerts` section), logged as they start.
        nonfinite=False: the record is known to hold no NaN/Inf (host_record said so), and is not searched."""
        self.collections += 1
        holding: Dict[tuple, Dict[str, Any]] = {}
        for code, severity, message, group in itertools.chain(
                _nonfinite_alerts(record) if nonfinite else (), self._loss_spikes(record), self._gradient_spikes(record),
                _lr_zero_alerts(record), self._frozen_groups(record)):
            if (code, group) not in holding:
                holding[(code, group)] = {"code": code, "severity": severity, "message": message,
                                          **({"group": group} if group is not None else {})}
        new = [alert for key, alert in holding.items() if key not in self.active]
        self.active = set(holding)
        for alert in new:
            _LOGGER.warning("telemetry alert at step %s [%s]: %s", record.get("step"), alert["code"],
                            alert["message"])
        self.pending.extend(new)
        return new or None

    def take(self) -> List[Dict[str, Any]]:
        pending, self.pending = self.pending, []
        return pending

    def measured_other_tensors(self) -> None:
        """The trainable tensors changed (a backbone unfrozen, a group added): the overall gradient norm is now
        another sum, and the old one's history says nothing of it (a head's alone is far below the whole
        model's)."""
        self.history["grad"].clear()

    def _loss_spikes(self, record):
        loss = record.get("loss")
        if not _finite_number(loss):
            return
        history = self.history["loss"]
        if len(history) >= MIN_ALERT_HISTORY:
            z, median, worst = robust_z(history, loss), statistics.median(history), max(history)
            # Near 0 (late in a run of small batches) one hard example is many times the median and many robust
            # SDs above it: a spike also rises by SPIKE_VISIBLE of the run's scale, its first losses' highest.
            # Batches of one or a few have a heavy tail, wide on the log scale: SPIKE_PAST_WORST times the
            # window's worst loss is a spike however many SDs that is.
            past, by_z = worst > 0 and loss > SPIKE_PAST_WORST * worst, z > self.config.alert_spike_threshold
            if (by_z or past) and loss > SPIKE_MIN_RATIO * abs(median) \
                    and loss - median > SPIKE_VISIBLE * max(map(abs, self.first_losses)):
                how = (f"{z:.1f} robust SDs above its rolling median" if by_z
                       else f"{loss / worst:.1f}x the worst of the window")
                yield ("loss_spike", "warning", f"loss {loss:.4g} is {how}, whose median is {median:.4g}", None)
        history.append(loss)
        if len(self.first_losses) < 10:
            self.first_losses.append(loss)

    def _gradient_spikes(self, record):
        norm = (record.get("gradient_norm") or {}).get("overall")
        if not _finite_number(norm):
            return
        cfg, history = self.config, self.history["grad"]
        if len(history) >= MIN_ALERT_HISTORY:
            median = statistics.median(history)
            z = robust_z(history, norm)
            # An explosion is a spike that is also an order of magnitude: late in training gradient norms
            # are heavy-tailed (one hard batch among fitted ones), and that alone is not one.
            spike = z > cfg.alert_spike_threshold and not self._loss_falling(record)
            if spike and norm > cfg.alert_explosion_factor * median > 0:
                yield ("grad_explosion", "critical", f"gradient norm {norm:.4g} is {norm / median:.0f}x its "
                                                     f"rolling median {median:.4g}", None)
            elif spike and norm > SPIKE_MIN_RATIO * median:
                yield ("grad_spike", "warning", f"gradient norm {norm:.4g} is {z:.1f} robust SDs above its "
                                                f"rolling median {median:.4g}", None)
        history.append(norm)

    def _loss_falling(self, record) -> bool:
        """Whether this record's loss is 3 robust SDs below its rolling median: gradients that grow while the
        loss falls through its own noise band are a model starting to learn (leaving a plateau where its
        gradients were tiny), not a blow-up, which leaves the loss where it was or higher."""
        loss, losses = record.get("loss"), list(self.history["loss"])[:-1]  # _loss_spikes added this one
        return _finite_number(loss) and len(losses) >= MIN_ALERT_HISTORY and robust_z(losses, loss) < -3

    def _frozen_groups(self, record):
        moved = "weight_delta" if "weight_delta" in record else "update_ratio"
        for kind, section in (("gradient", "gradient_norm"), ("update", moved)):
            values = record.get(section) or {}
            moving = _finite_number(values.get("overall")) and values["overall"] > 0
            for group, value in values.items():
                if group == "overall":
                    continue
                # The first collection never counts: LoRA's A has an exactly-zero gradient at step 1.
                frozen = moving and _finite_number(value) and value == 0 and self.collections > 1
                streak = self.frozen_streak.get((kind, group), 0) + 1 if frozen else 0
                self.frozen_streak[(kind, group)] = streak
                if streak >= 2:
                    yield ("frozen_group", "warning", f"group {group!r}: {kind} exactly 0 for {streak} "
                                                      "collections while other groups move", group)


def _nonfinite_alerts(record: Dict[str, Any]):
    _, paths = replace_nonfinite(record)
    paths = [p for p in paths if not p.startswith(("update_ratio", "custom"))]
    tensors = record.get("nonfinite_params") or []
    if (record.get("grad_scaler") or {}).get("skipped"):
        # The scaler saw these gradients and skipped the step; weights gone bad still show in the weight paths.
        paths, tensors = [p for p in paths if "grad" not in p], []
    if paths or tensors:
        shown = ", ".join(paths[:4]) + (", ..." if len(paths) > 4 else "")
        if tensors:
            shown += f" (tensors: {', '.join(tensors[:4])}{', ...' if len(tensors) > 4 else ''})"
        yield "nonfinite", "critical", f"non-finite values: {shown.strip()}", None


def _lr_zero_alerts(record: Dict[str, Any]):
    lrs = {g: v for g, v in (record.get("learning_rates") or {}).items()
           if g not in ("overall", "not_in_optimizer") and _finite_number(v)}
    if any(v > 0 for v in lrs.values()):
        for group, lr in lrs.items():
            if lr == 0:
                yield "lr_zero", "warning", f"group {group!r} has learning rate 0 while other groups train", group


def resolve_output_dir(template: str) -> str:
    """output_dir with {date} (YYYYmmdd-HHMMSS) and {host} filled in, for a directory per run."""
    if "{" not in template:
        return template
    try:
        return template.format(date=datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), host=socket.gethostname())
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"output_dir: {template!r} has a placeholder other than {{date}} and {{host}} "
                         f"({exc!r})") from None


def _run_model(directory: str) -> Optional[str]:
    """The model fingerprint that the run in `directory` recorded in its run.json, if it can be read."""
    try:
        with open_regular(os.path.join(directory, RUN_FILE)) as f:
            info = json.loads(f.read().decode("utf-8"))
        return info.get("model") if isinstance(info, dict) else None
    except (OSError, ValueError):
        return None


def model_fingerprint(model: torch.nn.Module) -> str:
    """The model's parameter names, shapes and dtypes, hashed: a resumed run has the same, another model not."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return digest.hexdigest()[:16]


# ---- the run directory ---------------------------------------------------------------------------


_LOCK_FDS: set = set()  # descriptors of the directory locks this process holds


def _release_lock(fd: int) -> None:
    _LOCK_FDS.discard(fd)
    with contextlib.suppress(OSError):
        os.close(fd)


def _drop_inherited_locks() -> None:
    """In a forked child (a DataLoader worker, say): let go of the parent's directory locks, which the child's
    copies of their descriptors would otherwise hold on to after the parent's close(). Each number is
    pointed at /dev/null rather than closed, so that what the child's copy of a finalizer closes later is
    never another file that took the number."""
    if not _LOCK_FDS:
        return
    null = os.open(os.devnull, os.O_RDONLY)
    for fd in _LOCK_FDS:
        with contextlib.suppress(OSError):
            os.dup2(null, fd)
    os.close(null)
    _LOCK_FDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited_locks)


class _RunFiles:
    """The run directory's files: telemetry.jsonl (one line per record), run.json (what the run is), the lock
    that keeps a second writer out, and the records the HF callback holds back until the Trainer has
    logged their step. Rank 0 alone writes records and run.json.

    A write that fails (full or unwritable disk) is warned about once; then telemetry stops, or, on a rank
    that other ranks wait for in collectives (lockstep), it goes on collecting and stops writing.
    """

    def __init__(self, output_dir: str, config: TelemetryConfig, warn: _Warnings, mirrors: _Mirrors):
        self.output_dir = output_dir
        self.records_path = os.path.join(output_dir, RECORDS_FILE)
        self.run_path = os.path.join(output_dir, RUN_FILE)
        self.strict, self.warn, self.mirrors = config.strict, warn, mirrors
        self.writer = _rank_and_world()[0] == 0
        self.lockstep = False
        self.stopped = False  # a write failed: telemetry is off for the rest of the run
        self.skip = False  # a write failed on a lockstep rank: it keeps collecting and writes nothing
        self.fd: Optional[int] = None  # telemetry.jsonl, opened for appending on first use
        self.lock: Optional[Any] = None  # finalizer that closes the lock file (and so releases the lock)
        self.holding = False
        self.held: List[Dict[str, Any]] = []
        self.info: Dict[str, Any] = {}
        self.start_index = 0  # this start's index in run.json's starts; its first record carries it
        self.start_pending = True
        self.resumed = False  # records of an earlier start are on disk

    def start(self, config: TelemetryConfig) -> int:
        """Take the directory (the lock), set aside what cannot be ours, record this start in run.json;
        returns the optimizer steps taken so far (a resume goes on counting from there): those counted when the
        last start closed (run.json's `steps`), or the step of the last readable record after a crash."""
        os.makedirs(self.output_dir, exist_ok=True)
        if self.writer:
            self._set_aside_strangers()
            self._lock()
        step = self._last_logged_step()
        self.resumed = step > 0
        self.info = self._load_info()
        closed = self.info.get("steps")
        step = max(step, closed) if type(closed) is int else step
        self.info["starts"].append(datetime.datetime.now().isoformat())
        self.start_index = len(self.info["starts"]) - 1
        self.info.update(schema=SCHEMA_VERSION, torch_version=torch.__version__, config=dataclasses.asdict(config))
        self.write(self.write_info)  # a full disk: one warning, and telemetry is off
        return step

    def abandon(self) -> None:
        """Take this start back out of run.json and let go of the directory (the run moves elsewhere)."""
        if self.info.get("starts"):
            self.info["starts"].pop()
            self.write_info()
        self.close()

    def update_info(self, **values: Any) -> None:
        self.info.update(values)
        self.write_info()

    def write_info(self) -> None:
        if not self.writer:
            return

        def write(path, info):
            tmp = path + ".tmp"
            with os.fdopen(_create_exclusive(tmp), "w", encoding="utf-8") as f:
                json.dump(info, f, indent=1, default=_json_default)
            os.replace(tmp, path)
        self.write(write, self.run_path, self.info)

    def append(self, record: Dict[str, Any]) -> None:
        if not self.writer:  # one writer per run
            return
        if self.holding:
            self.held.append(record)
            return
        self.mirrors.send(record)  # first, so that a mirror's error is in the line
        line = json.dumps(record, allow_nan=False, separators=(",", ":"), default=_json_default)
        self.write(self._append_line, line)

    @contextlib.contextmanager
    def hold(self):
        """Records made inside are held back until release()."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False

    def release(self) -> None:
        """Write the held records, in order."""
        held, self.held, holding = self.held, [], self.holding
        self.holding = False
        try:
            for record in held:
                self.append(record)
        finally:
            self.holding = holding

    def write(self, fn: Callable, *args: Any) -> Any:
        """fn(*args), a write; on a full or unwritable disk, warn once and stop (training goes on)."""
        if self.skip:
            return None
        try:
            return fn(*args)
        except OSError as exc:
            if self.strict:
                raise
            if self.lockstep:  # the other ranks still collect: keep taking part, stop writing
                self.skip = True
            else:
                self.stopped = True
            self.warn("disk", f"telemetry: cannot write to {self.output_dir} ({exc}); telemetry is "
                              "off for the rest of this run, training goes on")
            return None

    def close(self, steps: Optional[int] = None) -> None:
        """Write what is held, mark the end of this start in run.json with the optimizer steps taken so far
        (`steps`: the next start counts on from them) and let go of the files. Never raises for I/O: the run
        is over either way.

        run.json's `ends` is aligned with `starts`: ends[k] is when start k closed, null while it runs or
        when it never closed (a crash). A restart appends to `starts` only, so the run is open again until
        it closes; `analyze_telemetry.py --watch` stops when the last start has its end."""
        try:
            self.release()
        except OSError as exc:  # strict, and the disk failed
            self.warn("disk", f"telemetry: cannot write to {self.output_dir} ({exc}) while closing")
        starts, ends = self.info.get("starts") or [], self.info.get("ends")
        ends = list(ends) if isinstance(ends, list) else []
        # Not for a start that abandon() took back, nor twice, nor once writing has failed.
        if self.start_index < len(starts) and not self.stopped and not self.skip and (
                len(ends) <= self.start_index or ends[self.start_index] is None):
            ends = (ends + [None] * len(starts))[:len(starts)]
            ends[self.start_index] = datetime.datetime.now().isoformat()
            try:
                self.update_info(ends=ends, **({} if steps is None else {"steps": steps}))
            except OSError as exc:  # strict, and the disk failed
                self.warn("disk", f"telemetry: cannot write to {self.output_dir} ({exc}) while closing")
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
        if self.lock is not None:
            self.lock()  # closes the lock file: the lock is released

    def _append_line(self, line: str) -> None:
        # Unbuffered: a write that fails leaves nothing behind in a buffer for close() to trip over.
        data = (line + "\n").encode()
        if self.fd is None:
            fd = os.open(self.records_path, os.O_RDWR | os.O_APPEND | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC, 0o644)
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data  # a torn last line from a crash stays on its own line
            self.fd = fd
        start, view = os.fstat(self.fd).st_size, memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except OSError:  # a full disk took part of the line: cut it off again, no torn record is left
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, start)
            raise

    def _lock(self) -> None:
        """Hold an OS lock on telemetry.lock while this instance is open: a second writer would measure
        each other's weights. Released by close(), by garbage collection, and by the OS at exit."""
        if fcntl is None:  # no flock (Windows): one writer per directory is then the user's to keep
            return
        path = os.path.join(self.output_dir, LOCK_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RuntimeError(
                f"output_dir {self.output_dir!r} is in use by another TrainingTelemetry (process {holder}): two "
                "writers would measure deltas against each other's weights. close() the other one, or give "
                "this run its own output_dir, e.g. output_dir='runs/{date}_{host}'") from None
        _LOCK_FDS.add(fd)
        self.lock = weakref.finalize(self, _release_lock, fd)
        with contextlib.suppress(OSError):  # the pid only names the holder to a refused second writer
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def _set_aside_strangers(self) -> None:
        """Anything but a regular file where telemetry keeps its files (a FIFO would hang open(), a link
        would be written through) is renamed out of the way, with one warning that names it."""
        moved = []
        with os.scandir(self.output_dir) as entries:
            for entry in entries:
                if entry.name.startswith(_OWN_FILES) and ".aside-" not in entry.name and (
                        entry.is_symlink() or not entry.is_file(follow_symlinks=False)):
                    moved.append((entry.name, _keep_aside(entry.path, "aside")))
        if moved:
            self.warn("aside", f"telemetry: in {self.output_dir}, " + "; ".join(
                f"{name} was not a regular file and is now {os.path.basename(new)}" for name, new in moved))

    def _load_info(self) -> Dict[str, Any]:
        try:
            with open_regular(self.run_path) as f:
                info = json.loads(f.read().decode("utf-8"))
            if not isinstance(info, dict):
                raise ValueError(f"a JSON {type(info).__name__}, not an object")
            info.setdefault("starts", [])
            if not isinstance(info["starts"], list) or not all(isinstance(t, str) for t in info["starts"]):
                raise ValueError("'starts' is not a list of times")
            return info
        except FileNotFoundError:
            return {"starts": []}
        except (OSError, ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            kept = None
            if self.writer:
                with contextlib.suppress(OSError):
                    kept = _keep_aside(self.run_path, "damaged")
            self.warn("run-json", f"telemetry: {self.run_path} was damaged ({type(exc).__name__}: "
                                  f"{str(exc)[:200]}); it is kept as {os.path.basename(kept or '?')} and a new "
                                  "one is started")
            return {"starts": []}

    def _last_logged_step(self) -> int:
        """The step of the last readable record, so a resumed run keeps counting where it stopped. What
        follows it (a torn line, garbage) is named in one warning and left in place for the analyzer."""
        try:
            with open_regular(self.records_path) as f:
                size = os.fstat(f.fileno()).st_size
                chunk = 1 << 16
                while True:
                    f.seek(max(0, size - chunk))
                    lines = f.read(min(chunk, size)).splitlines(keepends=True)
                    lines = lines[1:] if size > chunk else lines
                    for skipped, line in enumerate(reversed(lines)):
                        step = _record_step(line)
                        if step is not None:
                            self._warn_tail(skipped, line.endswith(b"\n"))
                            return step
                    if size <= chunk:
                        self._warn_tail(len(lines), True)
                        return 0
                    chunk *= 4
        except OSError:
            return 0

    def _warn_tail(self, unreadable: int, ends_with_newline: bool) -> None:
        if unreadable:
            self.warn("tail", f"telemetry: {self.records_path} ends with {unreadable} line(s) that are not "
                              "records (a crash mid-write, or damage); they are left in place and new records "
                              "start on a line of their own")


def _record_step(line: bytes) -> Optional[int]:
    """The step of one complete record line, or None for anything else (torn, damaged, hostile)."""
    if not line.endswith(b"\n"):
        return None
    try:
        step = json.loads(line, parse_constant=_no_constant)["step"]
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):
        return None
    return step if type(step) is int and 0 <= step < 2 ** 63 else None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number in strict JSON")


def _keep_aside(path: str, why: str) -> str:
    """Rename `path` to the first free `path.<why>-N` and return the new name (damage is kept, not lost)."""
    n = 1
    while os.path.lexists(f"{path}.{why}-{n}"):
        n += 1
    os.replace(path, f"{path}.{why}-{n}")
    return f"{path}.{why}-{n}"


# ---- the layout: trainable parameters in a fixed order, and the groups they belong to ---------------


@dataclass
class _Layout:
    """Trainable parameters in a fixed order and the groups they belong to (cached per model/optimizer)."""
    key: tuple
    optimizer: Callable[[], Any]  # a weak reference: a new optimizer may be given a freed one's id()
    names: List[str]
    params: List[torch.nn.Parameter]
    group_names: List[str]
    membership: torch.Tensor  # [groups, params] 0/1 float32; rows [:first_partition] partition "overall"
    first_partition: int
    lr_names: List[str]
    group_lrs: List[Callable[[], Any]]  # reads a group's current lr
    frozen: Dict[str, List[tuple]] = dataclasses.field(default_factory=dict)  # group -> (name, frozen tensor)
    outside: List[tuple] = dataclasses.field(default_factory=list)  # trainable, but in no optimizer group
    beyond: List[tuple] = dataclasses.field(default_factory=list)  # (optimizer group, tensor) not in the model
    complex: List[tuple] = dataclasses.field(default_factory=list)  # trainable complex tensors: not measured
    ignored: Dict[str, Dict[str, Any]] = dataclasses.field(default_factory=dict)  # see ignored_group_keys
    # optimizer group -> the lr its scheduler started from (the key LR schedulers add to a param group)
    initial_lrs: Dict[str, float] = dataclasses.field(default_factory=dict)
    settings: Dict[str, Dict[str, Any]] = dataclasses.field(default_factory=dict)  # see _group_settings
    max_lrs: Dict[str, float] = dataclasses.field(default_factory=dict)  # the peak OneCycleLR puts in a group
    row_cache: Dict[str, tuple] = dataclasses.field(default_factory=dict)
    # device -> by_group's rows there: the overall one (the first partition's rows added up), then the membership
    totals: Dict[Any, torch.Tensor] = dataclasses.field(default_factory=dict)

    def nulls(self) -> Dict[str, Any]:
        """A per-group section with nothing measured (no reference yet, no gradients)."""
        return {"overall": None, **{g: None for g in self.group_names}}

    def by_group(self, per_tensor_sq: torch.Tensor, has: Optional[torch.Tensor] = None) -> Dict[str, Any]:
        """Per-group norms from per-tensor squared norms; with `has`, a group without any tensor that has
        a value is null rather than 0."""
        if not self.params:  # nothing measured: a sum over no tensor would read as a model that never moves
            return self.nulls()
        device = per_tensor_sq.device
        totals = self.totals.get(device)
        if totals is None:  # once per device: a small model's collection is mostly such fixed costs
            totals = self.totals[device] = torch.cat([
                self.membership[:self.first_partition].sum(0, keepdim=True), self.membership]).to(device)
        # One product and one unbind give every value: an op per group would cost a small model more.
        overall, *norms = (totals @ per_tensor_sq).sqrt().unbind()
        out: Dict[str, Any] = {"overall": overall}
        counts = (self.membership @ has.cpu().float()).tolist() if has is not None else None
        for i, name in enumerate(self.group_names):
            out[name] = None if counts is not None and counts[i] == 0 else norms[i]
        return out

    def learning_rates(self) -> Dict[str, Any]:
        lrs = {name: read() for name, read in zip(self.lr_names, self.group_lrs)}
        plain = [v for v in lrs.values() if not isinstance(v, torch.Tensor)]
        tensors = [v for v in lrs.values() if isinstance(v, torch.Tensor)]
        overall = max(plain + [t.max() for t in tensors]) if tensors else max(plain, default=None)
        return {"overall": overall, **lrs}

    def local_named(self) -> List[tuple]:
        """(name, this rank's part of the tensor) for every trainable tensor."""
        return [(n, local_part(p)) for n, p in zip(self.names, self.params)]

    def rows(self, by: str) -> tuple:
        """(row names, row of each tensor as a device LongTensor, the same as a list) for by = layer, group,
        tensor or component. Tensors that match no row (components only) get row len(rows)."""
        hit = self.row_cache.get(by)
        if hit is not None:
            return hit
        if by == "tensor":
            labels = list(self.names)
        elif by == "group":
            first = self.membership[:self.first_partition]
            labels = [self.group_names[int(first[:, i].argmax())] for i in range(len(self.params))]
        elif by == "layer":
            labels = [layer_key(n) for n in self.names]
        else:
            labels = [component_of(n) for n in self.names]
        rows = list(dict.fromkeys(label for label in labels if label is not None))
        position = {row: k for k, row in enumerate(rows)}
        as_list = [position.get(label, len(rows)) for label in labels]
        device = self.params[0].device if self.params else "cpu"
        hit = self.row_cache[by] = (rows, torch.tensor(as_list, dtype=torch.long, device=device), as_list)
        return hit


def _layout_key(model: torch.nn.Module, optimizer: Any) -> tuple:
    opt_groups = getattr(optimizer, "param_groups", None) or []
    # Which tensors are trainable, not how many: a swap (one layer frozen as another is unfrozen) keeps the count.
    return (id(model), id(optimizer), tuple(len(g["params"]) for g in opt_groups), _trainable_ids(model))


_PLAIN_MODULE_TYPES: set = set()  # module classes that walk their parameters and submodules as nn.Module does
_MODULE_WALKS = ("parameters", "named_parameters", "_named_members", "named_modules")


def _trainable_ids(model: torch.nn.Module) -> tuple:
    """(id(p) for p in model.parameters() if p.requires_grad), from a walk of the modules' own dicts. It is
    checked at every collection, and model.parameters() yields each tensor up through one generator per
    level of nesting: on a LoRA transformer of thousands of modules that takes milliseconds. The same
    order (modules depth first, as named_modules) and the same deduplication (a module or tensor reached
    twice counts once); where a class overrides how parameters or submodules are walked, parameters()."""
    base = torch.nn.Module
    seen_modules, seen_params, ids = set(), set(), []
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen_modules:
            continue
        seen_modules.add(id(module))
        kind = type(module)
        if kind not in _PLAIN_MODULE_TYPES:
            if any(getattr(kind, n) is not getattr(base, n) for n in _MODULE_WALKS):
                return tuple(id(p) for p in model.parameters() if p.requires_grad)
            _PLAIN_MODULE_TYPES.add(kind)
        for p in module._parameters.values():
            if p is not None and id(p) not in seen_params:
                seen_params.add(id(p))
                if p.requires_grad:
                    ids.append(id(p))
        stack.extend(child for child in reversed(module._modules.values()) if child is not None)
    return tuple(ids)


def build_layout(model: torch.nn.Module, optimizer: Any, config: TelemetryConfig) -> tuple:
    """(_Layout, partitions): the trainable parameters and their groups. The first partition is the config's
    name patterns, else the optimizer's param groups (by their "name"), else one group "all"; with LoRA a
    second partition (lora_A, lora_B, ...) comes beside it. Each group reads its learning rate live.
    Trainable tensors that no optimizer group holds are left out (their gradients only ever accumulate)
    and listed in layout.outside; frozen tensors are counted per group in layout.frozen. Tensors the
    optimizer steps that are not the model's (a loss module's weights) have no name to record them under:
    they are listed in layout.beyond."""
    opt_groups = getattr(optimizer, "param_groups", None) or []
    opt_index = {id(p): gi for gi, g in enumerate(opt_groups) for p in g["params"]}
    opt_names = _unique_names([str(g.get("name") or f"group_{gi}") for gi, g in enumerate(opt_groups)])
    every = list(model.named_parameters())
    held = [(n, p) for n, p in every if not opt_groups or id(p) in opt_index]
    held_ids = {id(p) for _, p in held}
    named = [(n, p) for n, p in held if p.requires_grad and not p.is_complex()]
    frozen = [(n, p) for n, p in held if not p.requires_grad]
    names, params = [n for n, _ in named], [p for _, p in named]

    def reader(gi):
        return (lambda: opt_groups[gi]["lr"]) if gi is not None else (lambda: 0.0)

    def majority(tensors):  # the optimizer group that holds most of these tensors
        gis = [opt_index.get(id(p)) for p in tensors]
        return reader(max(set(gis), key=gis.count) if gis else None)

    readers: Dict[str, Callable] = {}
    if config.groups:
        # Tied weights (an LM head sharing the embedding's) are one tensor under its first name only.
        primary = {id(p): n for n, p in every}
        tied = {n: primary[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if primary[id(p)] != n}
        first = _partition_by_patterns([n for n, _ in every], names, config.groups, tied)
        frozen_in = _partition_by_patterns([n for n, _ in every], [n for n, _ in frozen], config.groups, tied)
        for g in dict.fromkeys([*first, *frozen_in]):
            members = [params[i] for i in first.get(g, [])] or [frozen[i][1] for i in frozen_in.get(g, [])]
            readers[g] = majority(members)
        # The optimizer's groups too: the record shows both.
        readers.update((n, reader(gi)) for gi, n in enumerate(opt_names) if n not in readers)
    elif opt_groups:
        first = _partition_by_optimizer(params, opt_index, opt_names)
        frozen_in = _partition_by_optimizer([p for _, p in frozen], opt_index, opt_names)
        readers.update((n, reader(gi)) for gi, n in enumerate(opt_names))
    else:
        first, frozen_in = {"all": list(range(len(params)))}, {"all": list(range(len(frozen)))}
        readers["all"] = reader(None)
    partitions = [first]
    if config.track_lora and not config.groups:  # LoRA groups, beside the optimizer's
        lora = _lora_partition(model, params, first)
        if lora:
            partitions.append(lora)
            readers.update((g, majority([params[i] for i in idx])) for g, idx in lora.items())
    group_names = [g for part in partitions for g in part]
    membership = torch.zeros(len(group_names), len(params))
    for row, idx in enumerate(idx for part in partitions for idx in part.values()):
        membership[row, idx] = 1.0
    # Learning rates also name optimizer groups that hold no trainable parameter of their own here.
    lr_names = group_names + [n for n in readers if n not in group_names]
    layout = _Layout(key=_layout_key(model, optimizer), optimizer=_weak(optimizer), names=names, params=params,
                     group_names=group_names, membership=membership, first_partition=len(first), lr_names=lr_names,
                     group_lrs=[readers[g] for g in lr_names],
                     frozen={g: [frozen[i] for i in idx] for g, idx in frozen_in.items() if idx},
                     outside=[(n, p) for n, p in every if p.requires_grad and id(p) not in held_ids])
    layout.complex = [(n, p) for n, p in held if p.requires_grad and p.is_complex()]
    layout.ignored = ignored_group_keys(optimizer, opt_names)
    layout.initial_lrs, layout.max_lrs = ({n: float(g[key]) for n, g in zip(opt_names, opt_groups)
                                           if type(g.get(key)) in (int, float) and math.isfinite(g[key])}
                                          for key in ("initial_lr", "max_lr"))
    layout.settings = {n: settings for n, g in zip(opt_names, opt_groups) if (settings := _group_settings(g))}
    model_ids = {id(p) for _, p in every}
    if held:  # else the optimizer holds copies of the weights (master weights), not the model's tensors
        layout.beyond = [(opt_names[gi], p) for gi, g in enumerate(opt_groups) for p in g["params"]
                         if id(p) not in model_ids]
    return layout, partitions


# Keys that schedulers and common libraries add to param groups themselves: not misspellings.
_GROUP_EXTRAS = {"params", "name", "initial_lr", "max_lr", "min_lr", "base_lr", "max_momentum", "base_momentum",
                 "lr_scale", "swa_lr"}
_GROUP_ALIASES = {"learningrate": "lr", "learnrate": "lr", "lrate": "lr", "wd": "weight_decay",
                  "weightdecay": "weight_decay", "weightdecayrate": "weight_decay", "mom": "momentum"}


def ignored_group_keys(optimizer: Any, names: List[str]) -> Dict[str, Dict[str, Any]]:
    """Param-group keys the optimizer never reads that look like one it does ("learning_rate" for "lr",
    "weight_decy"), with another value: {group name: {key: [value, the key it reads, its value]}}, `names`
    being the groups' names in the order of optimizer.param_groups. A head's 10x lr written under such a key
    was never applied, and nothing else in the run would say so."""
    members = getattr(optimizer, "members", None) or ([optimizer] if optimizer is not None else [])
    pairs = [(g, getattr(o, "defaults", None) or {}) for o in members for g in getattr(o, "param_groups", [])]
    found: Dict[str, Dict[str, Any]] = {}
    for name, (group, defaults) in zip(names, pairs):
        for key, value in group.items():
            if key in defaults or key in _GROUP_EXTRAS or not isinstance(key, str) or isinstance(value, bool) \
                    or not isinstance(value, (int, float)):
                continue
            plain = key.lower().replace("_", "").replace("-", "")
            meant = _GROUP_ALIASES.get(plain) or next((k for k in defaults if k.replace("_", "") == plain), None) \
                or next(iter(difflib.get_close_matches(key, list(defaults), n=1, cutoff=0.85)), None)
            if meant in group and group[meant] != value:
                found.setdefault(name, {})[key] = [value, meant, group[meant]]
    return found


def _weak(obj: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:  # None, or an object that takes no weak reference
        return lambda: obj


def _unique_names(names: List[str]) -> List[str]:
    """Group names made unique by a suffix (decay, decay_2): two optimizers built by one helper give their
    groups the same names, and groups merged under one name would mix their norms and keep one lr."""
    taken, out = set(names), []
    for name in names:
        if name in out:
            k = 2
            while f"{name}_{k}" in taken:
                k += 1
            name = f"{name}_{k}"
            taken.add(name)
        out.append(name)
    return out


def _partition_by_optimizer(params: List[torch.Tensor], opt_index: Dict[int, int],
                            opt_names: List[str]) -> Dict[str, List[int]]:
    """Each tensor in its optimizer group. A group with no trainable parameter (the HF Trainer's empty
    no-decay group, a frozen backbone) is left out: it has a learning rate but no gradient or delta, and a
    0 there would read as a group that stopped moving."""
    groups: Dict[str, List[int]] = {n: [] for n in opt_names}
    for i, p in enumerate(params):
        groups[opt_names[opt_index[id(p)]]].append(i)
    return {n: idx for n, idx in groups.items() if idx}


def _partition_by_patterns(every: List[str], names: List[str], groups: Dict[str, List[str]],
                           tied: Optional[Dict[str, str]] = None) -> Dict[str, List[int]]:
    """Each of `names` in the first group with a matching pattern; the others in "other" (absent when empty).
    A pattern that matches no parameter of the model at all (`every`) is a typo: a ValueError naming it.
    `tied` maps the other names of tied weights to the one name they are counted under: a pattern that
    matches only such names is an error that says so, not a typo."""
    for group, patterns in groups.items():
        for pattern in patterns:
            if not any(param_matches(name, pattern) for name in every):
                aliases = [f"{alias} (tied to {name})" for alias, name in (tied or {}).items()
                           if param_matches(alias, pattern)]
                if aliases:
                    raise ValueError(f"groups: pattern {pattern!r} of group {group!r} matches only tied weights: "
                                     f"{', '.join(aliases[:3])}; a tied tensor is counted once, under the name it "
                                     "is tied to: put a pattern for that name in the group it belongs to")
                shown = ", ".join(every[:3]) + (", ..." if len(every) > 3 else "")
                raise ValueError(f"groups: pattern {pattern!r} of group {group!r} matches no parameter of the "
                                 f"model (its names look like {shown})")
    chosen: Dict[str, List[int]] = {g: [] for g in groups}
    for i, name in enumerate(names):
        group = next((g for g, pats in groups.items() if any(param_matches(name, p) for p in pats)), "other")
        chosen.setdefault(group, []).append(i)
    return {g: idx for g, idx in chosen.items() if idx}


def _lora_partition(model, params, first: Dict[str, List[int]]) -> Dict[str, List[int]]:
    """lora_A, lora_B, lora_magnitude (DoRA) and the other trainable parameters, when there is LoRA.

    A group that the first partition already has with the same members is left out (same numbers), and
    so is "other" when some optimizer group holds exactly those; a name the first partition uses for
    other members gets a "_lora" suffix, so record keys never collide.
    """
    roles: Dict[int, str] = {}
    for _, module, adapter in find_lora_modules(model):
        a, b = lora_factors(module, adapter)
        roles[id(a)], roles[id(b)] = "lora_A", "lora_B"
        m = dora_magnitude(module, adapter)
        if m is not None:
            roles[id(m)] = "lora_magnitude"
    if not roles:
        return {}
    part: Dict[str, List[int]] = {"lora_A": [], "lora_B": [], "lora_magnitude": [], "other": []}
    for i, p in enumerate(params):
        part[roles.get(id(p), "other")].append(i)
    same = [idx for idx in first.values()]
    return {(g + "_lora" if g in first else g): idx for g, idx in part.items()
            if idx and first.get(g) != idx and not (g == "other" and idx in same)}


_GROUP_SETTINGS = ("betas", "eps", "momentum", "weight_decay")


def _group_settings(group: Dict[str, Any]) -> Dict[str, Any]:
    """A param group's settings that say how its steps are made, as numbers (run.json's optimizer_settings):
    Adam's betas and eps, SGD's momentum, the weight decay. Tensor-valued ones are left out."""
    out: Dict[str, Any] = {}
    for key in _GROUP_SETTINGS:
        value = group.get(key)
        if type(value) in (int, float) and math.isfinite(value):
            out[key] = float(value)
        elif isinstance(value, (tuple, list)) and value and all(type(v) in (int, float) for v in value):
            out[key] = [float(v) for v in value]
    return out


def unregistered_parameters(model: torch.nn.Module) -> Dict[str, List[int]]:
    """{attribute path: [tensors, elements]} of trainable tensors that a module holds in a plain list, tuple or
    dict (of modules or parameters) rather than an nn.ModuleList, ModuleDict or ParameterList, that got a
    gradient and are not parameters of the model: the forward uses them, and model.parameters() (the
    optimizer built from it), .to() and state_dict() never see them. A plain list of modules that are
    registered elsewhere, or of frozen ones (a teacher kept out of the state_dict), is left out."""
    registered = {id(p) for p in model.parameters()}
    out: Dict[str, List[int]] = {}
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr.startswith("_") or not isinstance(value, (list, tuple, dict)):
                continue
            tensors = [p for item in (value.values() if isinstance(value, dict) else value)
                       for p in (item.parameters() if isinstance(item, torch.nn.Module) else
                                 [item] if isinstance(item, torch.nn.Parameter) else [])
                       if p.requires_grad and p.grad is not None and id(p) not in registered]
            registered.update(id(p) for p in tensors)
            if tensors:
                out[f"{name}.{attr}" if name else attr] = [len(tensors), sum(p.numel() for p in tensors)]
    return out


def layout_info(model: torch.nn.Module, optimizer: Any, layout: _Layout, partitions: List[dict]) -> Dict[str, Any]:
    """What run.json says about the parameters and groups: per group its trainable tensors and, where some
    of its parameters are frozen (requires_grad=False), those too; trainable tensors outside the optimizer,
    and those outside the model's parameters (unregistered_parameters)."""
    def count(tensors):
        return {"tensors": len(tensors), "elements": sum(p.numel() for _, p in tensors),
                "names": [n for n, _ in tensors]}

    groups = {}
    for part in partitions:
        for g, idx in part.items():
            groups[g] = count([(layout.names[i], layout.params[i]) for i in idx])
    for g, tensors in layout.frozen.items():
        frozen = count(tensors)
        groups.setdefault(g, count([])).update(
            frozen_tensors=frozen["tensors"], frozen_elements=frozen["elements"], frozen_names=frozen["names"])
    info = dict(parameters={"total": sum(p.numel() for p in model.parameters()),
                            "trainable": sum(p.numel() for p in layout.params)},
                groups=groups, optimizer="+".join(type(o).__name__ for o in getattr(optimizer, "members", [optimizer]))
                if optimizer is not None else None,
                world_size=1, rank=0)
    if layout.outside:
        # with no gradient, no backward reaches them: a copy of the model (an EMA), not tensors left out
        info["not_in_optimizer"] = dict(count(layout.outside),
                                        gradients=sum(p.grad is not None for _, p in layout.outside))
    if layout.ignored:
        info["ignored_group_keys"] = layout.ignored
    if layout.initial_lrs:
        info["initial_lrs"] = layout.initial_lrs
    if layout.max_lrs:
        info["max_lrs"] = layout.max_lrs
    if layout.settings:
        info["optimizer_settings"] = layout.settings
    if layout.complex:
        info["complex"] = count(layout.complex)
    if layout.beyond:
        info["not_in_model"] = {"tensors": len(layout.beyond), "elements": sum(p.numel() for _, p in layout.beyond),
                                "groups": sorted({g for g, _ in layout.beyond})}
    # a share dropped of half or more: TensorFlow's keep_prob written as torch's p drops what it meant to keep
    heavy = {name: float(m.p) for name, m in model.named_modules()
             if isinstance(m, torch.nn.modules.dropout._DropoutNd) and isinstance(m.p, (int, float)) and m.p >= 0.5}
    if heavy:
        info["dropout"] = heavy
    # batch statistics over a handful of examples are noise, and the running ones evaluation uses are not the
    # ones the model trained with: the analyzer sets these against the batch sizes
    tracking = [(name, m) for name, m in model.named_modules()
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    norms = [name for name, m in tracking if not isinstance(m, torch.nn.SyncBatchNorm)]  # that one pools the ranks
    if norms:
        info["batchnorm"] = norms[:20]
    # momentum=0 keeps the running statistics where they are: at their initial 0 and 1 (no pretrained ones to
    # keep), evaluation normalises with those and not with the data's
    frozen = [name for name, m in tracking if m.momentum == 0 and m.running_mean is not None
              and not m.running_mean.any() and bool((m.running_var == 1).all())]
    if frozen:
        info["batchnorm_stats_at_init"] = frozen[:20]
    low = _low_precision_groups(optimizer, layout, partitions)
    if low:
        info["low_precision"] = low
    unregistered = unregistered_parameters(model)
    if unregistered:
        info["unregistered"] = unregistered
    return info


def _low_precision_groups(optimizer: Any, layout: _Layout, partitions: List[dict]) -> Dict[str, Dict[str, Any]]:
    """{group: {dtype: elements, "optimizer": its class, module included}} for the groups whose trainable
    tensors the optimizer steps in bfloat16 or float16 itself: a step smaller than half the spacing of those
    formats at a weight's size rounds to nothing. An optimizer that keeps float32 master copies holds those,
    not the model's tensors, which are then outside every group and not here."""
    owners = {id(p): o for o in getattr(optimizer, "members", [optimizer]) if o is not None
              for g in getattr(o, "param_groups", ()) for p in g["params"]}
    low: Dict[str, Dict[str, Any]] = {}
    for part in partitions:
        for g, idx in part.items():
            counts: Dict[str, Any] = {}
            for i in idx:
                p = layout.params[i]
                if p.dtype in (torch.bfloat16, torch.float16):
                    dtype = str(p.dtype).replace("torch.", "")
                    counts[dtype] = counts.get(dtype, 0) + p.numel()
            owner = owners.get(id(layout.params[idx[0]])) if counts else None
            # the optimizer a wrapper steps through (accelerate's AcceleratedOptimizer, Lightning's)
            while owner is not None and hasattr(getattr(owner, "optimizer", None), "param_groups") \
                    and owner.optimizer is not owner:
                owner = owner.optimizer
            if owner is not None:
                low[g] = dict(counts, optimizer=f"{type(owner).__module__}.{type(owner).__qualname__}")
    return low


# ---- one collection ----------------------------------------------------------------------------------


@dataclass
class _Deferred:
    """A section waiting for the cross-rank sum of its rows (see _Sharded.reduce)."""
    section: str
    shapes: List[tuple]
    ops: List[str]  # "sum" or "max", per row
    rows: Optional[List[torch.Tensor]]  # this rank's rows; None when local() raised here
    error: Optional[BaseException]
    finish: Callable[..., Any]


@dataclass
class _Collection:
    """One collection, from on_batch_end to the JSON line: the record, its errors, and what its sections hand
    to each other. It is made in _collect and dropped after it: nothing of one collection stays behind."""
    record: Dict[str, Any]
    started: float  # perf_counter at the start, for telemetry_ms and the system clock
    strict: bool
    warn: _Warnings
    lockstep: bool = False  # other ranks wait for this one in collectives: strict errors wait for them
    errors: Dict[str, str] = dataclasses.field(default_factory=dict)
    layout: Optional[_Layout] = None
    changes: Optional[Dict[str, Any]] = None  # the streamed weight pass, per tensor (see streamed_weight_changes)
    reference_step: Optional[int] = None  # the step the weight reference held when this collection read it
    grad_profile: Optional[Dict[str, Any]] = None  # gradient norm per layer, from the gradient section
    previous_reference: Optional[str] = None  # the reference this collection replaced, kept for sparse quality
    deferred: List[_Deferred] = dataclasses.field(default_factory=list)
    strict_error: Optional[BaseException] = None

    def run(self, section: str, fn: Callable, *args: Any) -> Any:
        """fn(*args); an error is recorded under `section` and warned about once, and None is returned."""
        try:
            return fn(*args)
        except Exception as exc:
            if self.strict and not self.lockstep:
                raise
            if self.strict and self.strict_error is None:
                self.strict_error = exc  # raised once every rank is past the collectives
            self.errors[section] = f"{type(exc).__name__}: {exc}"
            self.warn(f"error:{section}", f"telemetry: {section} failed ({self.errors[section]}); it is "
                                          "recorded under 'errors' and training goes on")
            return None

    def add(self, section: str, fn: Callable, *args: Any) -> None:
        value = self.run(section, fn, *args)
        if value is not None:
            self.record[section] = value


_RECORD_HEAD = ("schema", "step", "batch_idx", "epoch", "timestamp", "loss")


def _record_head(step: int, batch_idx: int, epoch: int, loss: Any, scalars: Dict[str, Any]) -> Dict[str, Any]:
    record: Dict[str, Any] = {"schema": SCHEMA_VERSION, "step": step, "batch_idx": batch_idx, "epoch": epoch,
                              "timestamp": datetime.datetime.now().isoformat()}
    if loss is not None:
        record["loss"] = _one_number(loss)
    for key, value in scalars.items():
        if key in record or key in _SECTION_KEYS:
            raise ValueError(f"on_batch_end: extra scalar {key!r} clashes with a record key")
        record[key] = _one_number(value)
    return record


def _one_number(value: Any) -> Any:
    # A one-element tensor of any shape (DataParallel's loss is [1] on one GPU) is recorded as the number.
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach()
    return value.reshape(()) if value.numel() == 1 else value


def _null_ratios_of_zero_weights(record: Dict[str, Any]) -> None:
    # ||W|| = 0 (a zero-initialised layer): no ratio, not an Inf.
    ratio, norms = record.get("update_ratio"), record.get("weight_norm")
    if isinstance(ratio, dict) and isinstance(norms, dict):
        for group, norm in norms.items():
            if norm == 0 and group in ratio:
                ratio[group] = None


def _warn_about_gradients(record: Dict[str, Any], warn: _Warnings) -> None:
    norms = record.get("gradient_norm")
    if not norms:
        return
    if norms.get("overall") is None:
        warn("no-grad", "telemetry: no gradients at collection time, recorded as null. "
                        "Call on_batch_end after optimizer.step() and before zero_grad(); and call zero_grad() "
                        "before backward() or after step(), never between them, where the optimizer steps on no "
                        "gradient.")
    elif norms["overall"] == 0.0 and record.get("loss") != 0.0:  # a hinge or triplet loss at 0 passes none
        warn("zero-grad", "telemetry: every gradient is exactly 0: zero_grad() ran before on_batch_end (call it "
                          "before zero_grad()), or nothing passes gradient back (an output cut to 0 by a final "
                          "ReLU, a sigmoid or tanh pushed to its limits by steps too large, a loss that does not "
                          "depend on the weights).")


def custom_metric_values(fn: Callable, model, optimizer, context) -> Dict[str, Any]:
    with _rng_kept():
        values = fn(model, optimizer, context)
    if not isinstance(values, dict):
        raise TypeError(f"returned a {type(values).__name__}, expected a dict of numbers")
    out = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            value = value.detach()
        elif not (value is None or isinstance(value, (bool, int, float))):
            raise TypeError(f"value {key!r} is a {type(value).__name__}, expected a number or a tensor")
        out[str(key)] = value
    return out


# ---- the sections computed from the layout and the streamed weight pass -----------------------------


def update_ratio_section(layout: _Layout, changes: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    if "delta_sq" not in changes or not layout.params:  # no reference yet, or nothing measured: null
        return layout.nulls()
    delta = layout.by_group(changes["delta_sq"])
    weight = layout.by_group(changes["weight_sq"])
    return {k: delta[k] / weight[k] for k in delta}


def drift_section(layout: _Layout, changes: Dict[str, torch.Tensor]) -> Optional[Dict[str, Any]]:
    return layout.by_group(changes["drift_sq"]) if "drift_sq" in changes else None


def weight_norm_section(layout: _Layout, changes: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    return layout.by_group(changes["weight_sq"])


def param_change_section(layout: _Layout, changes: Dict[str, Any], config: TelemetryConfig) -> Optional[Dict]:
    if "l1" not in changes:
        return None  # no reference yet: nothing changed "since the previous collection"
    wide, device = changes["l1"].dtype, changes["l1"].device
    numel = torch.tensor([p.numel() for p in layout.params], dtype=wide, device=device)
    n = numel.sum().clamp(min=1)
    sq = changes["delta_sq"].to(wide)
    mean = changes["sum"].sum() / n
    below = changes["below"][[changes["thresholds"].index(t) for t in config.param_change_thresholds]].to(wide)
    below_rel = changes["below_rel"].to(wide)
    out: Dict[str, Any] = {
        "l2": sq.sum().sqrt(), "l1": changes["l1"].sum(), "max_abs": changes["max_abs"].max(), "mean": mean,
        "std": (sq.sum() / n - mean.square()).clamp(min=0).sqrt(),
        "sign_flip_fraction": changes["flips"].sum().to(wide) / n,
        "sparsity": {threshold_key(t): below[k].sum() / n for k, t in enumerate(config.param_change_thresholds)},
        "sparsity_rel": {threshold_key(t): below_rel[k].sum() / n
                         for k, t in enumerate(config.param_change_rel_thresholds)}}
    for key, by in (("per_layer", "layer"), ("per_component", "component")):
        rows, index, _ = layout.rows(by)
        if not rows:
            continue

        def total(v):  # the last row collects tensors that match no row
            return torch.zeros(len(rows) + 1, dtype=wide, device=device).index_add_(0, index, v)

        count = total(numel).clamp(min=1)
        l2, mean_abs = total(sq).sqrt(), total(changes["l1"]) / count
        shares = torch.stack([total(b) for b in below]) / count if len(below) else None
        out[key] = {row: {"l2": l2[r], "mean_abs": mean_abs[r],
                          "sparsity": {threshold_key(t): shares[k, r]
                                       for k, t in enumerate(config.param_change_thresholds)}}
                    for r, row in enumerate(rows)}
    return out


def nonfinite_params(layout: _Layout) -> Optional[List[str]]:
    """Names of the trainable tensors whose weights or gradients hold NaN/Inf (one pass, one transfer).
    Sharded: this rank's parts only (no collective here: ranks may disagree about running it)."""
    if not layout.params:
        return None
    device = layout.params[0].device
    with_grad = [i for i, p in enumerate(layout.params) if p.grad is not None]
    grads = [local_part(layout.params[i].grad) for i in with_grad]
    finite = torch.cat([per_tensor_finite([local_part(p).detach() for p in layout.params], device),
                        per_tensor_finite([_dense(g) for g in grads], device)]).cpu().tolist()
    n = len(layout.params)
    bad = [i for i in range(n) if not finite[i]] + [i for k, i in enumerate(with_grad) if not finite[n + k]]
    names = list(dict.fromkeys(layout.names[i] for i in sorted(bad)))
    return names or None


# Per-tensor rows of the layer_stats section, summed over ranks (max for max and for -min, which carries min).
_STAT_ROWS = ("has", "sq", "sum", "zeros", "nans", "infs", "numel", "max", "negmin", "weight_sq")


def _local_grad_stats(layout: _Layout) -> List[torch.Tensor]:
    """The _STAT_ROWS of this rank's part of each gradient and weight (per_tensor_stats), with the identity
    of each reduction where a tensor has no gradient. `has` and `numel` are host rows: no sync to read them."""
    params = [local_part(p) for p in layout.params]
    device = params[0].device
    idx = [i for i, p in enumerate(layout.params) if p.grad is not None]
    grads = [_dense(local_part(layout.params[i].grad)) for i in idx]
    got = per_tensor_stats(grads, device)
    got["negmin"] = -got.pop("min")
    out = {"has": torch.zeros(len(params)), "numel": torch.zeros(len(params), dtype=torch.int64)}
    if idx:
        out["has"][idx] = 1.0
        out["numel"][idx] = torch.tensor([g.numel() for g in grads])
    where = torch.tensor(idx, device=device)
    for key in ("sq", "sum", "zeros", "nans", "infs", "max", "negmin"):
        out[key] = torch.full((len(params),), -math.inf if key in ("max", "negmin") else 0,
                              dtype=got[key].dtype, device=device)
        if idx:
            out[key][where] = got[key]
    out["weight_sq"] = per_tensor_sq_norms([p.detach() for p in params], device)
    return [out[k] for k in _STAT_ROWS]


def layer_stats_section(c: _Collection, layout: _Layout, ranks: Any, by: str) -> Any:
    """Gradient statistics and weight norm per row (layer, group or tensor): per-tensor sums pooled."""
    if not layout.params:
        return None
    rows, index, as_list = layout.rows(by)

    def finish(has, sq, total, zeros, nans, infs, numel, most, negmin, weight_sq):
        present = [i for i, (h, k) in enumerate(zip(has.tolist(), numel.tolist())) if h > 0 and k > 0]
        pooled = None
        if present:
            where = torch.tensor(present, dtype=torch.long, device=sq.device)
            stats = {"sq": sq[where], "sum": total[where], "zeros": zeros[where], "nans": nans[where],
                     "infs": infs[where], "numel": numel[present].to(sq.device), "max": most[where],
                     "min": -negmin[where]}
            pooled = pool_stats(stats, index[present], len(rows) + 1)
        weight_norm = torch.zeros(len(rows) + 1, dtype=weight_sq.dtype, device=weight_sq.device).index_add_(
            0, index.to(weight_sq.device), weight_sq).sqrt()
        return layer_entries(rows, pooled, {as_list[i] for i in present}, weight_norm)

    ops = ["max" if k in ("max", "negmin") else "sum" for k in _STAT_ROWS]
    n = len(layout.params)
    return ranks.reduce(c, "layer_stats", [(n,)] * len(_STAT_ROWS), lambda: _local_grad_stats(layout), finish, ops)


# ---- the ranks: decided once per layout, then asked the same questions whatever the parallelism ------


class _Replicated:
    """One process, or DDP: every rank holds the same weights and gradients, so rank 0 collects alone and
    telemetry starts no collective; a reduction is the local values themselves."""
    lockstep = False
    suffix = ".safetensors"

    def __init__(self, rank: int, world: int, kind: str):
        self.rank, self.world, self.kind = rank, world, kind
        self.keeps_reference = rank == 0
        self.disagree = False

    def collects(self, probe: Callable[[], str]) -> bool:
        return self.rank == 0

    def reduce(self, c: _Collection, section: str, shapes: List[tuple], local: Callable[[], Any],
               finish: Callable[..., Any], ops: Optional[List[str]] = None) -> Any:
        return finish(*local())

    def finish(self, c: _Collection) -> None:
        pass

    def over_batches(self, what: str, batches: List[Any], fn: Callable[[Any], Any]) -> Optional[List[Any]]:
        return [fn(batch) for batch in batches]

    def whole(self, section: str) -> None:
        pass


class _Sharded:
    """FSDP2 (DTensor parameters) and DeepSpeed: every rank holds a part of each tensor. Every rank collects
    its own part; the parts meet in one all_reduce per collection, each rank keeps the weight reference of
    its own part (last_checkpoint.rank{r}.safetensors), and only rank 0 writes the record."""
    lockstep = True

    def __init__(self, rank: int, world: int, kind: str, params: List[torch.Tensor]):
        self.rank, self.world, self.kind = rank, world, kind
        self.suffix = f".rank{rank}.safetensors"
        self.keeps_reference = True
        self.weights = replica_weights(params, world)
        self.agreed: Optional[str] = None
        self.disagree = False

    def collects(self, probe: Callable[[], str]) -> bool:
        """Once per layout and holdout: check that every rank will start the same collectives. A rank with
        another config, parameter count or holdout (set_holdout_data on rank 0 only) would wait forever in
        a collective the others never start; instead every rank turns telemetry off, together."""
        mine = probe()
        if self.agreed == mine:
            return True
        import torch.distributed as dist

        seen: List[Any] = [None] * self.world
        dist.all_gather_object(seen, mine)
        if len(set(seen)) == 1:
            self.agreed = mine
            return True
        self.disagree = True
        return False

    def reduce(self, c: _Collection, section: str, shapes: List[tuple], local: Callable[[], Any],
               finish: Callable[..., Any], ops: Optional[List[str]] = None) -> _Deferred:
        """A _Deferred section: local() is this rank's rows, and finish(*rows) runs in finish(c) on rows
        summed over the ranks. A row whose last dim is the number of trainable tensors holds per-tensor
        sums: it is weighted by replica_weights, so a replicated placement counts once. Other rows are flags
        (> 0 on some rank) or maxima. `shapes` are fixed in advance: a rank whose local() raises still sends
        zeros of those shapes, so no rank waits on a collective another skipped, and the section fails on
        every rank."""
        try:
            rows, error = [torch.as_tensor(r) for r in local()], None
            if [tuple(r.shape) for r in rows] != [tuple(s) for s in shapes]:
                raise ValueError(f"rows of shapes {[tuple(r.shape) for r in rows]}, expected {shapes}")
        except Exception as exc:  # reported after the collective, on every rank
            rows, error = None, exc
        deferred = _Deferred(section=section, shapes=[tuple(s) for s in shapes], ops=ops or ["sum"] * len(shapes),
                             rows=rows, error=error, finish=finish)
        c.deferred.append(deferred)
        return deferred

    def finish(self, c: _Collection) -> None:
        """Resolve every _Deferred of this collection: sum (or max) all their rows over the ranks in one
        float64 all_reduce per op, copy the result to the host once, and finish each section there, into
        the record key that holds it, if any."""
        pending, c.deferred = c.deferred, []
        if not pending:
            return
        summed = self._all_reduce(pending)
        at = {"sum": 0, "max": 0}
        for d in pending:
            rows = []
            for k, shape in enumerate(d.shapes):
                n, op = math.prod(shape), d.ops[k]
                row = summed[op][at[op]:at[op] + n].reshape(shape)
                at[op] += n
                dtype = d.rows[k].dtype if d.rows is not None else torch.float32
                rows.append(row.round().to(dtype) if not dtype.is_floating_point else row.to(dtype))
            failed = int(summed["sum"][at["sum"]])
            at["sum"] += 1
            fn, args = (_raise, [d.error]) if d.error is not None else (
                (_raise, [RuntimeError(f"failed on {failed} other rank(s)")]) if failed else (d.finish, rows))
            value = c.run(d.section, fn, *args)
            if isinstance(c.record.get(d.section), _Deferred):
                del c.record[d.section]
                if value is not None:
                    c.record[d.section] = value

    def _all_reduce(self, pending: List[_Deferred]) -> Dict[str, torch.Tensor]:
        import torch.distributed as dist

        device = _reduce_device()
        weights = self.weights.to(device, torch.float64)
        flat: Dict[str, List[torch.Tensor]] = {"sum": [], "max": []}
        for d in pending:
            for k, shape in enumerate(d.shapes):
                row = (d.rows[k] if d.rows is not None else torch.zeros(shape)).to(device, torch.float64)
                if d.ops[k] == "sum" and row.dim() and row.shape[-1] == len(weights):
                    row = row * weights
                flat[d.ops[k]].append(row.reshape(-1))
            flat["sum"].append(torch.tensor([0.0 if d.error is None else 1.0], dtype=torch.float64, device=device))
        summed = {}
        for op, parts in flat.items():
            if parts:
                vector = torch.cat(parts)
                dist.all_reduce(vector, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
                summed[op] = vector.cpu()
        return summed

    def over_batches(self, what: str, batches: List[Any], fn: Callable[[Any], Any]) -> Optional[List[Any]]:
        """fn over this rank's share of each batch (a collective forward needs every rank in every batch),
        gathered to rank 0 in holdout order: a split batch is every rank's share in rank order, an unsplit
        one rank 0's. A rank that failed still takes part, and the result then fails on rank 0 too."""
        import torch.distributed as dist

        results, split, failed = [], [], None
        for batch in batches:
            share, cut = rank_share(batch, self.rank, self.world)
            split.append(cut)
            try:
                results.append(fn(share))
            except Exception as exc:  # go on: the other ranks run the next batches' collective forwards
                failed = failed or exc
                results.append(None)
        mine = {"error": None if failed is None else f"{type(failed).__name__}: {failed}",
                "results": move_to(results, torch.device("cpu"))}
        every = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, every, dst=0)
        if failed is not None:
            raise failed
        if self.rank != 0:
            return None
        bad = [(r, m["error"]) for r, m in enumerate(every) if m["error"]]
        if bad:
            raise RuntimeError(f"{what} failed on rank {bad[0][0]}: {bad[0][1]}")
        return [m["results"][b] for b, cut in enumerate(split) for m in (every if cut else every[:1])]

    def whole(self, section: str) -> None:
        """Sections that need whole tensors: gathering them is what sharding avoids."""
        raise NotImplementedError(f"{section} does not support sharded (FSDP2) parameters yet")


def _ranks_for(model: torch.nn.Module, params: List[torch.Tensor], rank: int, world: int) -> Any:
    """How this process's parameters are held: decided here, once per layout, and nowhere else."""
    kind = _parallelism(model, params, world)
    return _Sharded(rank, world, kind, params) if kind in ("fsdp2", "deepspeed") else _Replicated(rank, world, kind)


# ---- the weights: gradient norms, and the reference on disk that deltas are measured against ---------


def _register_step_hook(hook: Callable) -> Any:
    from torch.optim.optimizer import register_optimizer_step_post_hook  # a submodule `import torch` leaves out

    return register_optimizer_step_post_hook(hook)


def layer_profile(layout: _Layout, per_tensor_sq: torch.Tensor, has: torch.Tensor) -> Dict[str, Any]:
    """Gradient L2 norm per layer (layer_key: a block index or a module), null for a layer without gradients:
    enough to see gradients vanish towards the input, from the per-tensor norms the section computed anyway."""
    rows, index, _ = layout.rows("layer")
    device = per_tensor_sq.device
    norms = torch.zeros(len(rows) + 1, dtype=per_tensor_sq.dtype, device=device).index_add_(
        0, index.to(device), per_tensor_sq).sqrt().unbind()
    counts = torch.zeros(len(rows) + 1).index_add_(0, index.cpu(), has.float().cpu()).tolist()
    return {row: norms[r] if counts[r] > 0 else None for r, row in enumerate(rows)}


class _OptimizerSteps:
    """Counts optimizer.step() calls through torch's global step post-hook, so that on_batch_end can tell a
    call right after an optimizer step from a micro-batch of gradient accumulation. Wrappers (accelerate's,
    Lightning's) are looked through by their .optimizer / ._optimizer; the hook goes with this object."""

    def __init__(self):
        self.counts: Any = weakref.WeakKeyDictionary()
        self.total = 0  # steps of any optimizer: the count for one that cannot be looked through
        me = weakref.ref(self)

        def hook(optimizer, args, kwargs):
            counter = me()
            if counter is not None:
                counter.counts[optimizer] = counter.counts.get(optimizer, 0) + 1
                counter.total += 1
        weakref.finalize(self, _register_step_hook(hook).remove)

    def counts_of(self, members: tuple) -> List[int]:
        """Steps of each optimizer since telemetry started. One the hook has not seen step (a wrapper it cannot
        look through, or one that has not stepped yet) is given the steps of every optimizer but the others."""
        found = [self._seen_count(o) for o in members]
        rest = self.total - sum(c for c in found if c is not None)
        return [rest if c is None else c for c in found]

    def _seen_count(self, optimizer: Any) -> Optional[int]:
        seen = set()
        while optimizer is not None and id(optimizer) not in seen:
            seen.add(id(optimizer))
            with contextlib.suppress(TypeError):  # not weak-referenceable: not an optimizer the hook saw
                if optimizer in self.counts:
                    return self.counts[optimizer]
            optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        return None


class _Schedule:
    """When to collect: only right after an optimizer step (a call without one is a micro-batch of gradient
    accumulation, whose gradients are partial), at the first step at or after each batch_idx that is a
    multiple of collect_every_n. Without an optimizer to watch, every call is a step."""

    def __init__(self, every: int):
        self.every = every
        self.steps = _OptimizerSteps()
        self.seen: Dict[int, int] = {}  # optimizer id (of each one in a list) -> its step count at the previous call
        self.due = False
        self.calls_without_step = 0
        self.batches_per_step = 1  # calls up to the latest step: its micro-batches, where each is passed
        self.collected_at: Optional[int] = None  # batch_idx of the latest collection, until the next step
        self.last_idx: Optional[int] = None  # batch_idx of the previous call
        self.strides: List[int] = []  # batch_idx's advance between calls one step apart each, the latest three

    def advance(self, optimizer: Any, batch_idx: int) -> int:
        """Optimizer steps since the previous call: 0 for a micro-batch."""
        if optimizer is None:
            taken = 1
        else:
            # Of several optimizers, the most steps any one took since the previous call: a call after which
            # any of them stepped is a step (a backbone's and a head's stepping on alternate batches, too).
            members = optimizer.members if isinstance(optimizer, _Optimizers) else (optimizer,)
            deltas = []
            for one, count in zip(members, self.steps.counts_of(members)):
                deltas.append(count - self.seen.get(id(one), 0))
                self.seen[id(one)] = count
            taken = max(deltas)
            if taken:
                self.batches_per_step = self.calls_without_step + 1
                if taken == 1 and not self.calls_without_step and self.last_idx is not None \
                        and batch_idx > self.last_idx:
                    self.strides = (self.strides + [batch_idx - self.last_idx])[-3:]
            self.calls_without_step = 0 if taken else self.calls_without_step + 1
            taken = max(taken, 0) or (1 if taken < 0 else 0)
        if taken:
            self.collected_at = None
        # A second call for the batch just collected (no step in between) does not ask for another collection.
        if batch_idx % self.every == 0 and batch_idx != self.collected_at or self._passed_multiple(batch_idx):
            self.due = True
        self.last_idx = batch_idx
        return taken

    def _passed_multiple(self, batch_idx: int) -> bool:
        """Whether a multiple of `every` came since the previous call of this epoch without a call of its own: a
        loop that calls only after its optimizer steps, every k batches of gradient accumulation, lands on
        few multiples. A smaller batch_idx than before is a new epoch, whose batches before it are unknown:
        there, as at the first call, only a multiple itself counts."""
        last = self.last_idx
        return last is not None and batch_idx > last and batch_idx // self.every > last // self.every

    def micro_batches(self) -> int:
        """Batches per optimizer step: the calls up to the latest step, where the hook is called for each
        micro-batch; where it is called only after steps, batch_idx's advance between those calls (the same
        over the latest three: a loop of gradient accumulation passes its loader's index)."""
        if self.batches_per_step > 1:
            return self.batches_per_step
        return self.strides[0] if len(self.strides) == 3 and len(set(self.strides)) == 1 else 1

    def will_collect(self, batch_idx: int) -> bool:
        return self.due or batch_idx % self.every == 0

    def take_due(self, batch_idx: int) -> bool:
        due, self.due = self.due, False
        if due:
            self.collected_at = batch_idx
        return due


class _Gradients:
    """Gradient norms per tensor, read by on_batch_end after the step or by capture_gradients before it
    (then clipping has not touched them yet), unscaled, for the collection of that step."""

    def __init__(self, scaler: _GradScaler):
        self.scaler = scaler
        self.captured: Optional[tuple] = None  # (layout key, step, rows) read before optimizer.step()
        self.seen: Optional[tuple] = None  # (weak reference to the first gradient, its version, step)

    def never_zeroed(self, layout: _Layout, step: int) -> Optional[int]:
        """The optimizer steps since the previous collection when over them the first gradient stayed the
        same tensor and changed in place exactly once per step: backward() added into it and nothing zeroed
        it (zero_grad either replaces the tensor or zeroes it in place, a second change per step). None
        otherwise, clipping or several backward() per step included, which this cannot tell apart."""
        g = next((p.grad for p in layout.params if p.grad is not None), None)
        version = getattr(g, "_version", None)
        last, self.seen = self.seen, ((weakref.ref(g), version, step) if isinstance(version, int) else None)
        if last is None or self.seen is None or last[0]() is not g:
            return None
        steps = step - last[2]
        return steps if steps > 0 and version - last[1] == steps else None

    @staticmethod
    def accumulation(layout: _Layout, micro_batches: int) -> Optional[Dict[str, int]]:
        """{"micro_batches", "backward_bound"} where an optimizer step takes several micro-batches, or where one
        takes one and its gradients were changed in place: the bound is 1 + the most in-place changes that any
        of the first gradients had when read (a tensor's version counter). Each backward() after the one that
        made a gradient adds into it in place, as do clipping and unscaling, so the bound is at least the
        backward() passes the gradients hold: one below micro_batches says zero_grad() ran between the
        micro-batches and the step used the last ones alone; one that varies from step to step, with a batch a
        step, says zero_grad() runs only every few steps."""
        versions = [v for p in layout.params[:16] if isinstance(v := getattr(p.grad, "_version", None), int)]
        if not versions or (micro_batches == 1 and max(versions) == 0):
            return None
        return {"micro_batches": micro_batches, "backward_bound": max(versions) + 1}

    def rows(self, layout: _Layout, optimizer: Any, pre_step: bool) -> tuple:
        """(||g||^2 of this rank's part of each gradient, unscaled, on its device; 1.0 where a gradient
        exists, on the host). DeepSpeed's partitioned gradients come through full_gradient."""
        grads = [full_gradient(p) for p in layout.params]
        idx = [i for i, g in enumerate(grads) if g is not None]
        has = torch.zeros(len(grads))
        has[idx] = 1.0
        for i in idx:
            if is_sharded(grads[i]) and any(pl.is_partial() for pl in grads[i].placements):
                raise ValueError(f"the gradient of {layout.names[i]} is Partial (not reduced yet)")
        present = [local_part(grads[i]) for i in idx]
        device = present[0].device if present else torch.device("cpu")
        sq = per_tensor_sq_norms([_dense(g) for g in present], device)
        if len(present) < len(grads):  # a tensor without a gradient holds 0 (and `has` says it has none)
            sq = torch.zeros(len(grads), dtype=torch.float32, device=device).index_copy_(
                0, torch.tensor(idx, dtype=torch.long, device=device), sq)
        scale = self.scaler.scale_of(optimizer, pre_step)
        if scale is not None:
            sq = sq / scale.to(device, torch.float32).square()
        return sq, has

    def capture(self, layout: _Layout, optimizer: Any, step: int, stepping: Any = None,
                rows: Optional[tuple] = None) -> None:
        """Read the gradients before the step (or take `rows`, read earlier, as rows() gives them). With
        `stepping`, one of several optimizers that step one after the other on gradients of their own (a
        GAN's, in manual optimization), only its tensors' readings replace those of an earlier capture for
        the same step."""
        sq, has = rows if rows is not None else self.rows(layout, optimizer, pre_step=True)
        if stepping is not None and self.captured is not None and self.captured[:2] == (layout.key, step):
            held = {id(p) for g in getattr(stepping, "param_groups", ()) for p in g["params"]}
            mine = torch.tensor([id(p) in held for p in layout.params])
            old_sq, old_has = self.captured[2]
            sq, has = torch.where(mine.to(sq.device), sq, old_sq.to(sq.device)), torch.where(mine, has, old_has)
        self.captured = (layout.key, step, (sq, has))

    def section(self, c: _Collection, layout: _Layout, optimizer: Any, step: int, ranks: Any) -> Any:
        captured, self.captured = self.captured, None
        # Read before this step by capture_gradients, for this very call.
        rows = captured[2] if captured is not None and captured[:2] == (layout.key, step) else None

        def finish(sq, has):
            if not bool(has.any()):
                return layout.nulls()
            c.grad_profile = layer_profile(layout, sq, has)
            return layout.by_group(sq, has=has > 0)
        n = len(layout.params)
        return ranks.reduce(c, "gradient_norm", [(n,), (n,)],
                            lambda: rows if rows is not None else self.rows(layout, optimizer, pre_step=False),
                            finish)


def _stat_signature(path: str) -> tuple:
    st = os.lstat(path)
    return st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class _WrittenHeaders:
    """The headers of the tensor files this process wrote, each with the file's stat right after the write.
    While that stat holds, the header needs no second read and check; a file that changed underneath (its
    size, times or inode), or that this process did not write, is read and checked (tensor_file_info)."""

    def __init__(self):
        self.known: Dict[str, tuple] = {}  # path -> (stat signature, (header, data offset, metadata))

    def info(self, path: str) -> tuple:
        """tensor_file_info(path), from memory while the file is as this process wrote it."""
        hit = self.known.get(path)
        if hit is not None:
            try:
                if _stat_signature(path) == hit[0]:
                    return hit[1]
            except OSError:
                pass
            del self.known[path]
        return tensor_file_info(path)

    def write(self, write: Callable[..., Any], path: str, named: List[tuple], meanwhile: Optional[Callable],
              metadata: Dict[str, str]) -> Any:
        """write(write_tensor_file, path, named, meanwhile, metadata), remembering what it wrote: the new file
        at path and, at path.spare, the previous one when it was still as written here."""
        previous = self._unchanged(path)
        spare = path + ".spare"
        self.known.pop(path, None)
        self.known.pop(spare, None)
        done: List[bool] = []
        header, blob = tensor_file_header(named, metadata)

        def tracked(*args):
            result = write_tensor_file(*args, header=(header, blob))
            done.append(True)
            return result
        result = write(tracked, path, named, meanwhile, metadata)
        if done:
            header = {k: v for k, v in header.items() if k != "__metadata__"}
            self.known[path] = (_stat_signature(path), (header, 8 + len(blob), dict(metadata)))
            if previous is not None and os.path.lexists(spare):
                self.known[spare] = (_stat_signature(spare), previous)
        return result

    def _unchanged(self, path: str) -> Optional[tuple]:
        hit = self.known.get(path)
        try:
            return hit[1] if hit is not None and _stat_signature(path) == hit[0] else None
        except OSError:
            return None


class _KeptMaps:
    """Memory maps of small tensor files (up to WHOLE_PASS_BYTES of data) kept from one collection to the next.

    Mapping a file afresh faults its pages in again at every collection, which costs a small model more
    than reading them. A reference is rewritten in place (write_tensor_file's spare), and a map shows what
    the file holds now, so a map stays valid while its file keeps its inode, size and header layout; anything
    else is mapped anew. The kept pages are the page cache's own: they count in RSS without using more
    memory. Large files are mapped per pass and handed back chunk by chunk (map_tensor_file)."""

    def __init__(self, headers: _WrittenHeaders):
        self.headers = headers
        self.kept: Dict[tuple, tuple] = {}  # (device, inode) -> (size, data offset, header, names, views)

    def map(self, path: str, names: List[str]) -> tuple:
        """map_tensor_file(path, names), through a kept map when the file is small and still laid out alike."""
        info = self.headers.info(path)
        st = os.lstat(path)
        if st.st_size - info[1] > WHOLE_PASS_BYTES:
            return map_tensor_file(path, names, info)
        key, layout = (st.st_dev, st.st_ino), (st.st_size, info[1], info[0], names)
        hit = self.kept.get(key)
        if hit is None or hit[0] != layout:
            if len(self.kept) >= 4:  # the reference, its spare and W_0 are what a run maps
                self.kept.pop(next(iter(self.kept)))
            hit = self.kept[key] = (layout, map_tensor_file(path, names, info)[0])
        return hit[1], _keep_pages


def _keep_pages(i: int, start: int, n: int) -> None:
    """The release of a kept map: its pages stay mapped for the next collection."""


class _ReferenceStore:
    """The weights on disk that changes are measured against: last_checkpoint (the previous collection),
    initial_weights (W_0 of drift, written once, at the hook's first call) and last_checkpoint's .spare,
    the reference before it, which sparse quality reads. Each file records the step it holds, so a run
    resumed after a crash measures from the step the reference really holds, whatever the crash point.
    Sharded, each rank keeps its own part's files."""

    def __init__(self, output_dir: str, config: TelemetryConfig, files: _RunFiles, warn: _Warnings):
        self.output_dir, self.config, self.files, self.warn = output_dir, config, files, warn
        self.suffix = ".safetensors"  # set by the ranks: .rank{r}.safetensors when sharded
        self.initial_pending = config.track_update_ratio  # W_0 is kept at the first call
        self.headers = _WrittenHeaders()
        self.maps = _KeptMaps(self.headers)
        # Set when the trainable tensors change while this process runs (a layer unfrozen, a group added): the
        # files then hold the old set by design, and the next collection starts them again without a warning.
        self.trainable_changed = False

    @property
    def checkpoint(self) -> str:
        return os.path.join(self.output_dir, REFERENCE_FILE.replace(".safetensors", self.suffix))

    @property
    def initial(self) -> str:
        return os.path.join(self.output_dir, INITIAL_FILE.replace(".safetensors", self.suffix))

    def usable(self, named: List[tuple]) -> tuple:
        """(path, step it holds) of the weight reference when it is sound and holds exactly these tensors
        (this rank's parts, if sharded); (None, None) otherwise, and it is rewritten at this collection."""
        if self.files.skip or not os.path.lexists(self.checkpoint):
            return None, None
        return self._sound(self.checkpoint, named, "reference", "the delta restarts here")

    def initial_for(self, named: List[tuple], step: int) -> Optional[str]:
        """The W_0 file of drift: kept while it matches the model (across resumes too), else written now,
        keeping the W_0 of every tensor the old file holds."""
        path = self.initial
        if os.path.lexists(path):
            if self._sound(path, named, "initial", "the drift of tensors it lacks is measured from here")[0]:
                return path
            named = self._keep_initial(path, named)
        self.headers.write(self.files.write, path, named, None, {"step": str(step)})
        return path if not self.files.stopped and os.path.exists(path) else None

    def _keep_initial(self, path: str, named: List[tuple]) -> List[tuple]:
        """`named` with the W_0 that the old file holds in place of those tensors (same name, shape and dtype).
        The trainable set changes mid-run (a group added to the optimizer, a layer unfrozen or frozen): the
        tensors that were there keep their drift from the start, and only those that joined start theirs now.
        The file is mapped, not copied; the rewrite goes to another file, replaced atomically."""
        try:
            info = self.headers.info(path)
        except (OSError, ValueError):  # damaged: _sound warned, and every tensor starts here
            return named
        held = [n for n, t in named if header_holds(info[0], n, t)]
        if not held:
            return named
        views, _ = map_tensor_file(path, held, info)
        old = dict(zip(held, views))
        return [(n, old.get(n, t)) for n, t in named]

    def _sound(self, path: str, named: List[tuple], what: str, then: str) -> tuple:
        try:
            header, _, metadata = self.headers.info(path)
        except (OSError, ValueError) as exc:
            self.warn(f"{what}-damaged", f"telemetry: {os.path.basename(path)} is damaged ({exc}); it is "
                                         f"written again and {then}")
            return None, None
        if header_matches(header, named):
            step = metadata.get("step", "")
            return path, int(step) if step.isdigit() else None
        if self.trainable_changed:
            return None, None
        self.warn(what, f"telemetry: {os.path.basename(path)} holds other tensors than the trainable parameters "
                        "now (a layer unfrozen or frozen, a parameter group added, a dtype or a shape changed; this "
                        f"rank's part of them, when sharded); {then}")
        return None, None

    def write(self, named: List[tuple], step: int) -> None:
        self.headers.write(self.files.write, self.checkpoint, named, None, {"step": str(step)})

    def measure(self, c: _Collection, layout: _Layout, ranks: Any, keep_previous: bool) -> Any:
        """The weight delta per group, from one streamed pass over the weights and their reference that also
        leaves in c.changes what update_ratio, drift, weight_norm, param_change and sparse_quality need;
        then the reference is rewritten. Sharded, each rank streams its own part against its own files and
        the per-tensor sums (max for max_abs) meet in the collection's reduction; two flags say whether some
        rank had no reference or no initial weights, which nulls those quantities everywhere."""
        cfg = self.config
        if any(hasattr(p, "ds_id") for p in layout.params):  # ZeRO-3 leaves empty placeholders in the model
            raise NotImplementedError("weight_delta does not support DeepSpeed ZeRO-3 parameters")
        named, step = layout.local_named(), c.record["step"]
        detail = cfg.track_param_change or cfg.track_sparse_quality
        thresholds = sorted(set(cfg.param_change_thresholds) | set(cfg.sparse_quality_thresholds)) if detail else []
        rel = cfg.param_change_rel_thresholds if cfg.track_param_change else []
        n = len(named)
        shapes = {"weight_sq": (n,), "delta_sq": (n,)}
        if cfg.track_update_ratio:
            shapes["drift_sq"] = (n,)
        if detail:
            shapes.update(l1=(n,), sum=(n,), max_abs=(n,), flips=(n,), below=(len(thresholds), n),
                          below_rel=(len(rel), n))

        def local():
            reference, c.reference_step = self.usable(named)
            initial = self.initial_for(named, step) if cfg.track_update_ratio else None
            self.trainable_changed = False
            changes = self._stream_while_writing(named, step, lambda put=None: streamed_weight_changes(
                named, reference, initial, thresholds, rel, detail, mapper=self.maps.map, put=put))
            if keep_previous and reference is not None:
                c.previous_reference = self._previous(named, step)
            rows = [changes[k] if k in changes else torch.zeros(shape) for k, shape in shapes.items()]
            return (*rows, torch.tensor([float(reference is None)]), torch.tensor([float(initial is None)]))

        def finish(*rows):
            changes = dict(zip(shapes, rows))
            if rows[-2].item() > 0:  # some rank had no reference: nothing "since the previous collection"
                for k in ("delta_sq", "l1", "sum", "max_abs", "flips", "below", "below_rel"):
                    changes.pop(k, None)
            if rows[-1].item() > 0:
                changes.pop("drift_sq", None)
            changes["thresholds"] = thresholds
            c.changes = changes
            return layout.by_group(changes["delta_sq"]) if "delta_sq" in changes else layout.nulls()
        ops = ["max" if k == "max_abs" else "sum" for k in shapes] + ["sum", "sum"]
        return ranks.reduce(c, "weight_delta", list(shapes.values()) + [(1,), (1,)], local, finish, ops)

    def _previous(self, named: List[tuple], step: int) -> Optional[str]:
        """The reference this collection replaced, which write_tensor_file keeps as .spare: it is there only
        when the new reference was written (it holds this step), and the spare is sound and whole."""
        spare = self.checkpoint + ".spare"
        try:
            if self.headers.info(self.checkpoint)[2].get("step") != str(step):
                return None  # the write failed: the spare is older than the reference
            return spare if header_matches(self.headers.info(spare)[0], named) else None
        except (OSError, ValueError):
            return None

    def _stream_while_writing(self, named: List[tuple], step: int, stream: Callable[[], Dict]) -> Dict:
        """stream(put) (the pass over the old reference) while the new reference is written, for large models
        (see _write_beside_pass): from the pass's own reads of the weights, or beside it from a device. The
        old file is replaced only after both, and a failed write (full disk) keeps stream()'s result."""
        result: List[Dict[str, torch.Tensor]] = []
        if _write_beside_pass([t for _, t in named]):
            self.headers.write(self.files.write, self.checkpoint, named, lambda put: result.append(stream(put)),
                               {"step": str(step)})
        else:
            result.append(stream())
            self.write(named, step)
        return result[0] if result else stream()


# ---- the holdout, and what is measured on it ---------------------------------------------------------


@contextlib.contextmanager
def _evaluating(model: torch.nn.Module):
    """model.eval() under no_grad; afterwards every module's mode and the RNG states are as they were, so an
    evaluation inside the training loop leaves the training exactly as it would have been."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        with _rng_kept():
            model.eval()
            with torch.no_grad():
                yield
    finally:
        for module, mode in modes:
            module.training = mode


def eval_mode_modules(model: torch.nn.Module) -> Optional[Dict[str, int]]:
    """{"dropout": n, "batchnorm": m} when the model is in eval mode at the hook, which a validation pass's
    model.eval() without a model.train() after it leaves: its dropout layers (p > 0) then drop nothing and its
    BatchNorm layers normalise with frozen running statistics while it trains. None in training mode, or
    when it has neither kind of layer (then the mode changes nothing); the walk runs only in eval mode."""
    if model.training:
        return None
    counts = {"dropout": 0, "batchnorm": 0}
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            counts["dropout"] += 1
        elif isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            counts["batchnorm"] += 1
    return counts if any(counts.values()) else None


def batch_stats(batch: Any, label_key: Optional[str], holdout: Optional["_Holdout"] = None) -> Dict[str, Any]:
    """The batch_stats section: label balance, or token counts for a language-model batch, and a fingerprint
    of the inputs (a loader that hands out the same batch again gives the same one); with a holdout and
    floating-point inputs, the sums that tell which of the batch's first examples are holdout examples
    (see _Holdout.overlap_sums)."""
    batch = plain_batch(batch)
    key = find_label_key(batch, label_key) if isinstance(batch, dict) else None
    per_example = key is not None and isinstance(batch[key], torch.Tensor) and batch[key].dim() <= 1
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor) and batch["input_ids"].dim() == 2 \
            and not per_example:  # a language model's batch; one label per sequence is a classifier's
        stats = token_balance(batch)
    elif key is not None:
        stats = label_balance(batch[key], key)
    elif isinstance(batch, (tuple, list)) and batch and isinstance(batch[-1], torch.Tensor):
        labels = batch[-1]
        if per_token_labels(batch[0], labels):  # (ids, targets) of a language model: token counts
            stats = token_balance({"input_ids": batch[0], "labels": labels})
        else:
            stats = label_balance(labels, label_key or "label")
    else:
        stats = {"batch_size": batch_size_of(batch)}
    inputs = batch_inputs(batch)
    if inputs is not None:
        stats["fingerprint"] = batch_fingerprint(inputs)
        if inputs.is_floating_point():  # with sum x^2, the inputs' scale (token ids have none)
            stats["input_elements"] = inputs.numel()
        # Token sequences are left out: a language model's data repeats whole prompts by construction (templates,
        # small synthetic tasks), and a holdout taken from its text shows in windows at other offsets.
        sums = holdout.overlap_sums(inputs) if holdout is not None and inputs.is_floating_point() else None
        if sums is not None:  # looked up once the record is on the host (see _Holdout.overlap)
            stats["holdout_sums"] = sums
    return stats


def batch_inputs(batch: Any) -> Optional[torch.Tensor]:
    """What batch_stats takes for a batch's inputs: its first tensor (of a dict's values, a tuple or a list)."""
    batch = plain_batch(batch)
    return next((t for t in (batch.values() if isinstance(batch, dict) else batch if isinstance(
        batch, (tuple, list)) else [batch]) if isinstance(t, torch.Tensor)), None)


def per_token_labels(inputs: Any, labels: torch.Tensor) -> bool:
    """Integer labels of the same [batch, seq] shape as integer inputs: a language model's next tokens (or a
    tagger's tags), one per token. Their shares follow the text, not the sampler, so they are not
    balanced as classes (a character LM's spaces and e's would read as class imbalance)."""
    return isinstance(inputs, torch.Tensor) and inputs is not labels and labels.dim() >= 2 \
        and inputs.shape == labels.shape and not inputs.is_floating_point() and not labels.is_floating_point() \
        and labels.dtype != torch.bool


def batch_fingerprint(inputs: torch.Tensor) -> List[torch.Tensor]:
    """[sum x, sum x^2] of a batch's first tensor: equal for the same batch, all but never for two different
    ones. float32 and float64 inputs are summed as they are (a float64 copy of an image batch cost more than
    the rest of the section); integers (token ids) and half precision in float64, exactly for integers
    (float32 on mps, which has no float64). On the device: it rides the record's one transfer."""
    x = inputs.detach()
    x = (x if x.dtype in (torch.float32, torch.float64) else x.to(_wide(x.device))).reshape(-1)
    return [x.sum(), torch.dot(x, x)]


def holdout_batches(data: Any, limit: int, label_key: Optional[str]) -> List[Any]:
    """Batches of at most `limit` examples in all, from any of: a DataLoader or another iterable of batches,
    a map-style Dataset (items are examples: tuples or dicts, collated here), a list of examples, one batch
    (a dict of tensors, or (inputs..., labels) tensors), a bare tensor (with labels=). Mappings that are not
    dicts (BatchEncoding) are kept as dicts."""
    data = plain_batch(data)
    if isinstance(data, torch.Tensor):
        return [data[:limit]]
    if isinstance(data, dict) or (isinstance(data, (tuple, list)) and data and isinstance(data[0], torch.Tensor)):
        return _first_examples([data], limit)
    if hasattr(data, "__getitem__") and hasattr(data, "__len__") and not isinstance(data, (tuple, list, str, bytes)):
        return [_collate([data[i] for i in range(min(len(data), limit))])] if len(data) and limit else []
    try:
        items = iter(data)
    except TypeError:
        raise ValueError(f"set_holdout_data: cannot read holdout examples from a {type(data).__name__}; pass a "
                         "DataLoader, a Dataset, a list of examples or batches, or (inputs, labels)") from None
    first = plain_batch(next(items, None))
    if first is None or not limit:
        return []
    if _is_example(first, label_key):
        return [_collate([first] + list(itertools.islice(items, limit - 1)))]
    return _first_examples(itertools.chain([first], items), limit)


def _first_examples(batches: Any, limit: int) -> List[Any]:
    kept, have = [], 0
    for batch in map(plain_batch, batches):
        if have >= limit:
            break
        n = _holdout_batch_size(batch)
        take = min(n, limit - have)
        kept.append(batch if take == n else slice_batch(batch, take))
        have += take
    return kept


def _holdout_batch_size(batch: Any) -> int:
    try:
        return batch_size_of(batch)
    except TypeError:
        raise ValueError(f"set_holdout_data: a holdout batch ({type(batch).__name__}) has no tensor with a batch "
                         "dimension; pass batches of tensors, or forward= and labels= to say how to use "
                         "them") from None


def _is_example(item: Any, label_key: Optional[str]) -> bool:
    """One example rather than a batch: its label is a number (a Python one, or a 0-dim tensor), or its
    token ids are one sequence."""
    if isinstance(item, dict):
        ids = item.get("input_ids")
        if ids is not None:
            return not (isinstance(ids, torch.Tensor) and ids.dim() >= 2)
        keys = [label_key] if label_key is not None else LABEL_KEYS
        label = next((item[k] for k in keys if k in item), None)
    elif isinstance(item, (tuple, list)) and item:
        label, first = item[-1], item[0]
        # One sequence of token ids with a label per token (a tagger's): a batch of such would be 2-D, and a
        # batch of one-token inputs is read the same way, a position per example
        if (isinstance(first, torch.Tensor) and isinstance(label, torch.Tensor) and len(item) >= 2
                and first.dim() == 1 and not first.is_floating_point() and label.shape == first.shape):
            return True
    else:
        return False
    return isinstance(label, (int, float)) or (isinstance(label, torch.Tensor) and label.dim() == 0)


def _collate(examples: List[Any]) -> Any:
    """Examples stacked into one batch; Python lists of numbers (tokenized text) become tensors first."""
    def tensors(x):
        if isinstance(x, dict):
            return {k: tensors(v) for k, v in x.items()}
        if isinstance(x, list) and x and all(isinstance(v, (int, float)) for v in x):
            return torch.tensor(x)
        if isinstance(x, (tuple, list)):
            return type(x)(tensors(v) for v in x)
        return x
    try:
        return torch.utils.data.default_collate([tensors(e) for e in examples])
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"set_holdout_data: the holdout examples cannot be stacked into a batch ({exc}); pass "
                         "batches instead (a DataLoader with a collate_fn that pads, for instance)") from None


def per_position(logits: torch.Tensor, labels: Any) -> Optional[tuple]:
    """Channel-first logits with a class per position, as a segmentation gives them ([N, C, *S] against
    labels [N, *S]; one channel against 0/1 masks [N, *S] or [N, 1, *S], as two classes with logits 0 and z,
    whose cross-entropy is the BCE): ([N, positions, C] logits, [N, positions] labels); else None."""
    if not isinstance(labels, torch.Tensor) or logits.dim() < 3 or labels.is_floating_point() and not \
            _zero_one(labels.detach()):
        return None
    n, channels, space = logits.shape[0], logits.shape[1], tuple(logits.shape[2:])
    if logits.dim() == 3 and tuple(labels.shape) == tuple(logits.shape[:2]):
        return None  # [N, T, V] against [N, T]: a sequence's tokens, channel last
    if channels == 1 and tuple(labels.shape) == tuple(logits.shape):
        labels = labels.reshape(n, *space)
    if tuple(labels.shape) != (n, *space):
        return None
    flat = logits.detach().float().movedim(1, -1).reshape(n, -1, channels)
    if channels == 1:
        flat = torch.cat([torch.zeros_like(flat), flat], -1)
    return flat, labels.reshape(n, -1).long()


def own_tokens(batch: Any, labels: torch.Tensor) -> bool:
    """Per-token labels that are the batch's own input tokens wherever they are supervised, as an HF causal
    LM takes them (it shifts them itself), or as a seq2seq decoder's input is by mistake when it is not shifted
    right (an (inputs..., labels) batch: any of its inputs); other per-token labels (tags, a masked LM's
    originals, a decoder's targets, next tokens shifted already) are scored at their own positions."""
    inputs = [batch.get("input_ids")] if isinstance(batch, dict) else list(batch[:-1] if len(batch) > 1 else batch) \
        if isinstance(batch, (tuple, list)) else []
    kept = labels.detach().cpu() != IGNORE_INDEX
    for ids in inputs:
        if isinstance(ids, torch.Tensor) and ids.shape == labels.shape and not ids.is_floating_point() \
                and bool(kept.any()) and bool((labels.detach().cpu()[kept] == ids.detach().cpu()[kept]).all()):
            return True
    return False


def token_input(batch: Any, labels: torch.Tensor) -> Any:
    """The key or index of the input whose token ids per-token labels are, wherever supervised: the same tokens
    (own_tokens) or the next ones (a language model's, shifted already); None for other labels (tags, a
    seq2seq decoder's targets)."""
    if labels.dim() != 2:
        return None
    found = [("input_ids", batch.get("input_ids"))] if isinstance(batch, dict) else list(enumerate(
        batch[:-1] if len(batch) > 1 else batch)) if isinstance(batch, (tuple, list)) else []
    labels = labels.detach().cpu()
    for key, ids in found:
        if not isinstance(ids, torch.Tensor) or ids.shape != labels.shape or ids.is_floating_point():
            continue
        ids = ids.detach().cpu()
        for ahead, here in ((labels, ids), (labels[:, :-1], ids[:, 1:])):
            kept = ahead != IGNORE_INDEX
            if bool(kept.any()) and bool((ahead[kept] == here[kept]).all()):
                return key
    return None


def holdout_labels(batch: Any, label_key: Optional[str], labels: Optional[Callable]) -> tuple:
    """(labels of a holdout batch, the dict key they came from): labels(batch) when given; else the batch's
    label key, or a causal LM's own input_ids; else the last element of an (inputs..., labels) batch."""
    if labels is not None:
        return labels(batch), None
    if isinstance(batch, dict):
        key = find_label_key(batch, label_key)
        if key is not None:
            return batch[key], key
        if isinstance(batch.get("input_ids"), torch.Tensor):  # a causal LM's labels are its inputs
            return batch["input_ids"], None
        tried = [label_key] if label_key is not None else list(LABEL_KEYS)
        raise ValueError(f"the holdout batch has no label key (tried {', '.join(tried)}; it has "
                         f"{', '.join(map(str, batch))}): set batch_label_key, or pass labels= to set_holdout_data")
    if isinstance(batch, (tuple, list)) and len(batch) >= 2 and isinstance(batch[-1], torch.Tensor):
        return batch[-1], None
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        raise ValueError(f"the labels of a holdout (inputs..., labels) batch are a {type(batch[-1]).__name__}, not a "
                         "tensor: pass them as one (torch.tensor(labels); class names mapped to class indices), "
                         "or pass labels= to set_holdout_data")
    raise ValueError(f"a holdout batch of type {type(batch).__name__} holds no labels: pass (inputs..., labels) "
                     "batches, or labels= (and forward=) to set_holdout_data")


# Activation modules whose units can die (ReLU family: output exactly 0) or saturate (a flat end of the
# curve: sigmoid below 0.01 or above 0.99, tanh and hardtanh beyond +-0.99), with the saturation test.
_DYING = ("ReLU", "ReLU6")
_SATURATING = {"Sigmoid": lambda y: (y < 0.01) | (y > 0.99), "Hardsigmoid": lambda y: (y <= 0) | (y >= 1),
               "Tanh": lambda y: y.abs() > 0.99, "Hardtanh": lambda y: y.abs() >= 0.99}
MAX_WATCHED_ACTIVATIONS = 64  # activation modules watched per model: enough for the layers that matter


class _ActivationWatch:
    """The `activations` section: per activation module, over the holdout forward only (hooks put on for
    it and taken off after, so training steps pay nothing), the share of ReLU-family units that never fire
    and the share of sigmoid/tanh outputs on a flat end. A unit is a feature (the last dim of [N, F] and
    [N, T, F]) or a channel ([N, C, H, W]). Sums stay on the device until the record's one transfer."""

    def __init__(self, model: torch.nn.Module):
        self.watched = [(name, m) for name, m in model.named_modules()
                        if type(m).__name__ in _DYING or type(m).__name__ in _SATURATING][:MAX_WATCHED_ACTIVATIONS]
        self.seen: Dict[str, Dict[str, Any]] = {}

    @contextlib.contextmanager
    def watching(self):
        handles = [m.register_forward_hook(functools.partial(self._observe, name)) for name, m in self.watched]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _observe(self, name: str, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not isinstance(output, torch.Tensor) or output.dim() < 2 or not output.is_floating_point():
            return
        kind = type(module).__name__
        output = output.detach()
        unit_dim = 1 if output.dim() == 4 else output.dim() - 1  # reduced in place: no copy of the output
        entry = self.seen.setdefault(name, {"kind": kind.lower(), "units": output.shape[unit_dim]})
        if kind in _DYING:  # a unit fired when its largest output is above 0: one reading pass
            fired = output.amax(dim=[d for d in range(output.dim()) if d != unit_dim]) > 0
            entry["fired"] = fired if "fired" not in entry else entry["fired"] | fired
        else:
            flat = _SATURATING[kind](output).sum()
            entry["flat"] = flat if "flat" not in entry else entry["flat"] + flat
            entry["values"] = entry.get("values", 0) + output.numel()

    def section(self) -> Optional[Dict[str, Any]]:
        out = {}
        for name, entry in self.seen.items():
            row = {"kind": entry["kind"], "units": entry["units"]}
            if "fired" in entry:
                row["dead"] = 1 - entry["fired"].float().mean()
            if "flat" in entry:
                row["saturated"] = entry["flat"].float() / max(entry["values"], 1)
            out[name or "model"] = row
        return out or None


# The first this many examples of each collected training batch are looked up among the holdout's: enough to
# find a holdout that is a few percent of the training data within a few dozen collections, at the cost of a
# few examples' sums. Two sums of an example's inputs equal to this relative tolerance make it one of them.
OVERLAP_ROWS = 8
OVERLAP_TOLERANCE = 1e-9


def _same_sums(a: List[float], b: List[float]) -> bool:
    """Whether two examples' overlap sums (plain, weighted) agree to OVERLAP_TOLERANCE: the same inputs."""
    return all(abs(x - y) <= OVERLAP_TOLERANCE * (abs(x) + abs(y)) for x, y in zip(a, b))


class _Holdout:
    """The fixed holdout set: up to holdout_size examples, how to run the model on them, where its
    predictions and labels are, whether it is regression, and the batches already moved to each device."""

    def __init__(self, config: TelemetryConfig):
        self.config = config
        self.batches: List[Any] = []
        self.on_device: Dict[str, List[Any]] = {}
        self.signatures: Dict[tuple, Optional[tuple]] = {}  # per (input size, device): see overlap_sums
        self.looked_up: Optional[tuple] = None  # the key of the last overlap_sums
        self.forward: Optional[Callable] = None
        self.labels: Optional[Callable] = None
        self.output: Any = None
        self.regression = False
        self.graded = False  # integer labels other than 0/1: one output per example is then a regression
        self.label_range: Optional[tuple] = None  # (least, greatest) integer label of a classification holdout
        self.shift = True  # per-token labels are the inputs' own tokens, shifted by the model (see own_tokens)
        self.sees_future: Optional[bool] = None  # see future_probe; None until probed
        self.eval_probe: Optional[Dict[str, float]] = None  # see order_probe; None until probed
        self.padding_row: Any = None  # see padded_row; None until looked for, False where there is none
        self.token_input: Any = None  # see token_input
        self.activations: Optional[Dict[str, Any]] = None  # what the last evaluation's forward showed
        # A bool on the device: no evaluation so far had one output per example outside [0, 1] (see
        # classification_holdout). None before the first.
        self.probabilities: Optional[torch.Tensor] = None

    def set(self, data: Any, forward: Optional[Callable], labels: Optional[Callable], output: Any) -> int:
        """Keep the first holdout_size examples, refusing here what could not be used later; returns how
        many were kept."""
        with _rng_kept():  # a DataLoader draws its iterator's seed from the global RNG, even unshuffled
            batches = holdout_batches(data, self.config.holdout_size, self.config.batch_label_key)
        found = []
        for batch in batches:
            n = _holdout_batch_size(batch)
            got = holdout_labels(batch, self.config.batch_label_key, labels)[0]
            if not isinstance(got, torch.Tensor) or not got.dim() or got.shape[0] != n:
                raise ValueError(f"set_holdout_data: the labels of a batch of {n} examples are "
                                 f"{type(got).__name__} {list(getattr(got, 'shape', []))}; pass labels= returning "
                                 "a tensor with one row per example")
            if _multi_label(got) and not (isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor)
                                          and batch["input_ids"].shape == got.shape):  # a language model's tokens
                one_hot = bool((got.reshape(n, -1).sum(-1) == 1).all())
                raise ValueError(f"set_holdout_data: labels of shape {list(got.shape)} holding only 0 and 1 are "
                                 "multi-label or one-hot targets, which the holdout does not score (it scores a "
                                 "class index per example, a language model's tokens, or regression targets); " +
                                 ("these are one-hot: pass labels=lambda batch: batch[-1].argmax(-1)" if one_hot else
                                  "these give some examples several labels or none, which a class index would "
                                  "misstate: leave the holdout out (the rest is still recorded)"))
            if forward is None and isinstance(batch, (tuple, list)) and not all(
                    isinstance(x, torch.Tensor) for x in batch[:-1]):
                raise ValueError("set_holdout_data: (inputs..., labels) batches run model(*inputs), and these "
                                 "inputs are not all tensors; pass forward=lambda model, batch: ...")
            found.append(got)
        self.batches, self.on_device, self.probabilities, self.signatures = batches, {}, None, {}
        self.sees_future = self.eval_probe = self.padding_row = None
        self.forward, self.labels, self.output = forward, labels, output
        self.regression = any(is_regression_target(t) for t in found)
        # Integer labels beyond 0/1 against one output per example: a regression on them (ordinal targets, or
        # class indices under MSE), which a binary reading would score with BCE against targets of 2 and more.
        indices = [t.detach().cpu().reshape(-1) for t in found if not t.is_floating_point() and t.dim() <= 1]
        self.graded = any(not _zero_one(t) for t in indices)
        # the class indices' range, checked against the model's outputs before scoring: an index past them is an
        # IndexError on the CPU, and on a GPU a device-side assert that ends the process's CUDA context
        kept = torch.cat(indices) if indices else torch.zeros(0, dtype=torch.long)
        kept = kept[kept != IGNORE_INDEX]
        self.label_range = (int(kept.min()), int(kept.max())) if len(kept) else None
        self.shift = next((own_tokens(b, t) for b, t in zip(batches, found) if t.dim() >= 2), True)
        # a language model's holdout, its labels shifted by the model or already: whether it sees ahead is probed
        # on the input they are the tokens of
        self.token_input = next((k for k in (token_input(b, t) for b, t in zip(batches, found)) if k is not None),
                                None)
        return sum(_holdout_batch_size(b) for b in batches)

    def input_scale(self) -> Dict[str, float]:
        """The mean and root mean square per element of the holdout's floating-point inputs (batch_inputs, as
        batch_stats reads the training batches'), for run.json: a holdout that skipped the training data's
        preprocessing shows on another scale. Empty for integer inputs (token ids)."""
        try:
            inputs = [x.detach() for x in map(batch_inputs, self.batches) if x is not None and x.is_floating_point()]
            n = sum(x.numel() for x in inputs)
            if not n or len(inputs) < len(self.batches):
                return {}
            total = torch.stack([torch.stack([x.double().sum(), x.double().square().sum()]).cpu()
                                 for x in inputs]).sum(0)
        except Exception:  # what telemetry only describes never stops set_holdout_data
            return {}
        mean, rms = float(total[0]) / n, math.sqrt(max(float(total[1]), 0.0) / n)
        return {"input_mean": mean, "input_rms": rms} if math.isfinite(mean) and math.isfinite(rms) else {}

    def token_entropy(self) -> Dict[str, Any]:
        """For a holdout of token sequences (a language model's, [examples, positions]), the entropy in nats of
        its scored tokens' own frequencies, for run.json: the least loss a model that ignores the context can
        score on it, and how many of its positions are scored: set against the share of positions the training
        batches supervise (their label_share), it tells a holdout scored where training never teaches. Empty
        for other holdouts (a segmentation's pixels too)."""
        try:
            targets, positions = [], 0
            for batch in self.batches:
                got = holdout_labels(batch, self.config.batch_label_key, self.labels)[0]
                if self.regression or got.is_floating_point() or got.dim() != 2 or got.shape[1] < 2:
                    return {}
                text = text_positions(batch.get("attention_mask") if isinstance(batch, dict) else None, got.shape)
                kept = got.detach() != IGNORE_INDEX
                if self.shift:  # as language_model_holdout scores them: none predicted at padding
                    kept = kept[:, 1:] & text[:, :-1].to(kept.device) if text is not None else kept[:, 1:]
                got = got.detach()[:, 1:] if self.shift else got.detach()
                targets.append(got[kept].cpu())
                positions += got.numel()
            _, counts = torch.cat(targets).unique(return_counts=True)
        except Exception:  # what telemetry only describes never stops set_holdout_data
            return {}
        n = int(counts.sum())
        shares = counts.double() / max(n, 1)
        return {"token_entropy": float(-(shares * shares.log()).sum()), "scored_tokens": n,
                "label_positions": positions} if n else {}

    def overlap_sums(self, inputs: torch.Tensor) -> Optional[torch.Tensor]:
        """Two sums of each of a training batch's first OVERLAP_ROWS examples' inputs, [rows, 2] in float64 on
        their device: plain, and with fixed random weights. They ride the record's one transfer, and overlap()
        looks them up among the holdout's on the host (a lookup on the device would cost more ops than the
        sums). None without a holdout, where the holdout's examples are not of the batch's size, or on a device
        without float64 (mps), whose float32 sums could not tell a match from rounding."""
        rows = inputs.detach()[:OVERLAP_ROWS]
        if not self.batches or not rows.dim() or not rows.shape[0] or _wide(rows.device) != torch.float64:
            return None
        rows = rows.reshape(rows.shape[0], -1)
        self.looked_up = (rows.shape[1], rows.device)
        held = self._signatures_for(self.looked_up)
        return None if held is None else rows.double() @ held[0]

    def input_pairs(self) -> Dict[str, int]:
        """How many pairs of holdout examples have the same inputs (overlap's two sums, to OVERLAP_TOLERANCE),
        for run.json. Where inputs repeat within the holdout (a small discrete input space: one-hot codes, a few
        categorical features), training examples match holdout ones about as often with the split done right,
        and the analyzer expects as many. Empty where overlap looks nothing up (token ids)."""
        try:
            first = next((x for x in map(batch_inputs, self.batches) if x is not None and x.dim()), None)
            if first is None or not first.is_floating_point():
                return {}
            held = self._signatures_for((first[0].numel(), torch.device("cpu")))  # CPU batches look up the same
        except Exception:  # what telemetry only describes never stops set_holdout_data
            return {}
        if held is None:
            return {}
        pairs, run = 0, 1  # equal examples sit next to each other in the sorted sums
        for a, b in zip(held[1], held[1][1:] + [None]):
            if b is not None and _same_sums(a, b):
                run += 1
            else:
                pairs, run = pairs + run * (run - 1) // 2, 1
        return {"input_pairs": pairs}

    def reconstructs(self) -> Dict[str, bool]:
        """{"targets_are_inputs": True} for run.json where every holdout batch's targets are its inputs, as an
        autoencoder's are: a model that predicts their mean for every example then passes nothing through its
        code, which is no sign of targets apart from their inputs."""
        try:
            found = [(batch_inputs(b), holdout_labels(b, self.config.batch_label_key, self.labels)[0])
                     for b in self.batches]
            same = bool(found) and all(isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                                       and x.shape == y.shape and x.is_floating_point()
                                       and torch.equal(x, y.to(x.device)) for x, y in found)
        except Exception:  # what telemetry only describes never stops set_holdout_data
            return {}
        return {"targets_are_inputs": True} if same else {}

    def overlap(self, sums: List[List[float]]) -> tuple:
        """(how many of the rows of overlap_sums, as numbers, are a holdout example's sums, to OVERLAP_TOLERANCE
        in both; how many rows; how many pairs of those rows are equal): a holdout drawn from the training data
        shows as training examples that are holdout ones. The pairs say how often training inputs repeat by
        themselves (a small discrete input space), and so how often they match holdout ones by chance."""
        held, found = self.signatures[self.looked_up], 0
        for row in sums:
            at = bisect.bisect_left(held[2], row[1])
            found += any(_same_sums(held[1][k], row) for k in (at - 1, at) if 0 <= k < len(held[1]))
        pairs = sum(_same_sums(a, b) for i, a in enumerate(sums) for b in sums[i + 1:])
        return found, len(sums), pairs

    def _signatures_for(self, key: tuple) -> Optional[tuple]:
        """_signatures(*key), computed once per (input size, device) for this holdout."""
        if key not in self.signatures:
            self.signatures[key] = self._signatures(*key)
        return self.signatures[key]

    def _signatures(self, size: int, device: torch.device) -> Optional[tuple]:
        """(weights [size, 2] on `device`, the holdout examples' two sums as [[plain, weighted], ...] sorted by
        the weighted one, those weighted sums) for inputs of `size` elements an example; None if the holdout's
        examples are of another size."""
        try:
            rows = [x.detach().reshape(x.shape[0], -1) for x in map(batch_inputs, self.batches)
                    if x is not None and x.dim()]
        except RuntimeError:
            return None
        if not rows or any(r.shape[1] != size for r in rows):
            return None
        drawn = torch.randn(size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))  # no RNG state used
        weights = torch.stack([torch.ones_like(drawn), drawn], 1)
        # A few examples at a time: a float64 copy of a whole holdout of images would double its memory.
        sums = sorted(torch.cat([part.double() @ weights for r in rows for part in r.split(OVERLAP_ROWS)]).tolist(),
                      key=lambda pair: pair[1])
        return weights.to(device), sums, [pair[1] for pair in sums]

    def sizes(self) -> List[int]:
        return [batch_size_of(b) for b in self.batches]

    def on(self, model: torch.nn.Module, device: Any) -> List[Any]:
        """The batches on `device`, their floating-point inputs (not their labels) in the dtype of the model's
        floating-point weights when they all have one (a model turned to bf16 or float64 before or during
        training runs on inputs of its dtype, as the loop's own inputs are)."""
        device = torch.device(device) if device is not None else _model_device(model)
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        dtype = dtypes.pop() if len(dtypes) == 1 else None
        key = f"{device}/{dtype}"
        batches = self.on_device.get(key)
        if batches is None:
            batches = self.on_device[key] = [self._inputs_as(move_to(b, device), dtype) for b in self.batches]
        return batches

    def _inputs_as(self, batch: Any, dtype: Optional[torch.dtype]) -> Any:
        if dtype is None:
            return batch
        labels = holdout_labels(batch, self.config.batch_label_key, None)[0] if self.labels is None else None
        return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype and t is not labels
                           else t, batch)

    def forward_one(self, model: torch.nn.Module, batch: Any) -> tuple:
        """(predictions, labels) of one holdout batch."""
        labels, label_key = holdout_labels(batch, self.config.batch_label_key, self.labels)
        if self.forward is not None:
            outputs = self.forward(model, batch)
        else:
            try:
                if isinstance(batch, dict):
                    # Labels are never passed: fused-loss models (unsloth) return no logits when given labels.
                    outputs = model(**{k: v for k, v in batch.items() if k != label_key})
                elif isinstance(batch, torch.Tensor):
                    outputs = model(batch)
                else:
                    outputs = model(*batch[:-1])
            except TypeError as exc:  # the model's signature does not take the batch this way
                how = "model(**batch without its label)" if isinstance(batch, dict) else "model(*inputs)"
                raise TypeError(f"the holdout runs {how}, and the model refused it ({exc}); pass "
                                "forward=lambda model, batch: ... to set_holdout_data") from exc
        return output_logits(outputs, self.output), labels

    def future_probe(self, model: torch.nn.Module, batch: Any, logits: torch.Tensor) -> Optional[bool]:
        """Whether a language model's predictions before the last position change when only the last input token
        does (another example's): a causal model's cannot, and one that sees the tokens it is to predict (a
        transformer without its causal mask) reads its next-token holdout near perfect while it generates
        nothing. One more forward, at the first evaluation; None where the batch's token ids are not found."""
        key = self.token_input
        ids = batch.get(key) if isinstance(batch, dict) else batch[key] if isinstance(batch, (tuple, list)) else None
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < 2 or ids.is_floating_point():
            return None
        changed = ids.clone()
        changed[:, -1] = ids[:, -1].roll(1, 0) if len(ids) > 1 and not torch.equal(ids[:, -1].roll(1, 0), ids[:, -1]) \
            else ids[:, 0]
        if torch.equal(changed, ids):
            return None
        items = [changed if i == key else x for i, x in enumerate(batch)] if not isinstance(batch, dict) else []
        altered = {**batch, key: changed} if isinstance(batch, dict) else type(batch)(*items) if hasattr(
            batch, "_fields") else type(batch)(items)  # a namedtuple takes its fields one by one
        other = self.forward_one(model, altered)[0].detach().float()[:, :-1]
        before = logits.detach().float()[:, :-1]
        if other.shape != before.shape:
            return None
        change, largest = (other - before).abs(), before.abs()
        text = text_positions(batch.get("attention_mask") if isinstance(batch, dict) else None, ids.shape)
        if text is not None and before.dim() >= 2:
            # Padding positions predict nothing, and need not be causal: a query at left padding has no key it may
            # attend to, and kernels fill such a row as they will, from every position included. Only the
            # positions of the text count.
            text = text[:, :-1].to(before.device)
            if not bool(text.any()):
                return None
            change, largest = change[text], largest[text]
        return bool(change.max() > 1e-3 * largest.max() + 1e-6)

    def order_probe(self, model: torch.nn.Module, batch: Any, logits: torch.Tensor) -> Optional[Dict[str, float]]:
        """Whether the model in eval() mode gives each example of a batch the same outputs on a second pass, and
        with the batch's examples in reverse order: {"repeat", "reorder"}, the median over the examples of the
        largest change of an example's outputs over its largest output (a median, so the rounding of a kernel
        that is not deterministic, which touches a few outputs by an ulp, reads as nothing). Something random
        left on in eval() moves the first (F.dropout defaults to training=True); a model that mixes examples
        along the batch axis the second (an nn.LSTM fed [batch, time, ...] without batch_first=True reads the
        batch as time). Two more forwards of one batch, at the first evaluation; None where they fail or give
        outputs of another shape."""
        n = batch_size_of(batch)
        before = logits.detach()
        dims = tuple(range(1, before.dim()))
        largest = before.abs().amax(dim=dims).float() if dims else before.abs().float()
        # an example whose outputs are all near 0 is measured against the batch's largest, not against rounding
        scale = torch.maximum(largest, 0.01 * largest.max()).clamp(min=1e-12)

        def change(other: torch.Tensor) -> Optional[torch.Tensor]:
            if other.shape != before.shape:
                return None
            diff = (other.detach() - before).abs()
            return ((diff.amax(dim=dims) if dims else diff).float() / scale).median()

        try:
            repeat = change(self.forward_one(model, batch)[0])
            flipped = map_tensors(lambda t: t.flip(0) if t.dim() and t.shape[0] == n else t, batch)
            reorder = change(self.forward_one(model, flipped)[0].flip(0))
        except Exception:  # one more forward that fails (memory, a model that takes one order only) says nothing
            return None
        if repeat is None or reorder is None:
            return None
        repeat, reorder = torch.stack([repeat, reorder]).tolist()
        return {"repeat": repeat, "reorder": reorder}

    def padded_row(self, batch: Any, logits: torch.Tensor, labels: Any) -> Optional[tuple]:
        """For padding_probe: (the row of a language model's batch with the most padding, alone and unpadded, as a
        batch of one; that row's logits at its tokens, [tokens, vocab]; its `labels` there), or None where the
        batch is not a dict of token ids whose attention_mask pads some row. The row and its positions are found
        once (one sync): the holdout's batches never change."""
        if self.padding_row is None:
            self.padding_row = False
            ids = batch.get(self.token_input) if isinstance(batch, dict) else None
            text = text_positions(batch.get("attention_mask"), ids.shape) if isinstance(ids, torch.Tensor) else None
            if text is not None:
                pads = (~text).sum(1).cpu()
                row = int(pads.argmax())
                if int(pads[row]):
                    self.padding_row = (row, text[row].nonzero().reshape(-1).cpu(), tuple(ids.shape),
                                        int(pads[row]))
        if not self.padding_row or logits.dim() != 3 or tuple(logits.shape[:2]) != self.padding_row[2]:
            return None
        row, keep, (n, length), _ = self.padding_row
        keep = keep.to(logits.device)
        if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != (n, length):
            return None
        alone = {k: v[row].index_select(0, keep.to(v.device))[None] if isinstance(v, torch.Tensor)
                 and tuple(v.shape[:2]) == (n, length) else v[row:row + 1]
                 if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n else v for k, v in batch.items()}
        return alone, logits.detach()[row].index_select(0, keep), labels[row].to(logits.device).index_select(0, keep)

    def padding_probe(self, model: torch.nn.Module, alone: Any, padded: torch.Tensor,
                      target: torch.Tensor) -> Optional[Dict[str, Any]]:
        """Whether a language model scores the tokens of its holdout's most padded row as it does with the row
        alone, unpadded: {"padding_nll": [the row's mean NLL in the batch, alone], "padding_positions": how many
        of its positions are padding, "padding_full_precision": whether the forward ran in float32 or wider}. A
        forward that masks its padding (or pads after the text, under a causal mask) differs by rounding; one that
        reads the padding as context (a left-padded batch through attention that ignores attention_mask) does
        not, and every score of a padded batch then measures the padding too.
        One more forward of one row an evaluation; None where it fails or gives outputs of another shape."""
        try:
            single = self.forward_one(model, alone)[0].detach()
        except Exception:  # one more forward that fails (a model that takes one shape only) says nothing
            return None
        if single.dim() != 3 or tuple(single.shape[1:]) != tuple(padded.shape):
            return None
        # Scored as the holdout scores a row, over the text's positions only: with the shift, the padded row's
        # first token (predicted from padding) is left out as the lone row has no position before it.
        nll = [language_model_holdout(x[None], target[None], shift=self.shift)["nll"] for x in (padded, single[0])]
        # A forward wholly in float32 (or wider) scores the row alike both ways to its last digits; one through
        # half-precision weights, autocast or reduced-precision matmuls may differ by its rounding.
        full = (padded.dtype in (torch.float32, torch.float64) and not torch.is_autocast_enabled(padded.device.type)
                and torch.get_float32_matmul_precision() == "highest"
                and all(p.dtype in (torch.float32, torch.float64) for p in model.parameters()))
        return {"padding_nll": torch.cat(nll), "padding_positions": self.padding_row[3],
                "padding_full_precision": full}

    def section(self, model: torch.nn.Module, device: Any, ranks: Any) -> Optional[Dict[str, Any]]:
        """The holdout_logits section: predictions, accuracy and loss (per-token NLL for language models,
        squared and absolute errors for regression)."""
        model = _unwrap_model(model)  # DDP's forward can broadcast buffers: a collective rank 0 must not start alone

        def score(batch):
            logits, labels = self.forward_one(model, batch)
            if self.eval_probe is None and not ranks.lockstep and not order and logits.dim() \
                    and logits.shape[0] == batch_size_of(batch) >= 2:
                order.append((batch, logits))  # probed below, once the activations are no longer watched
            dense = None if self.regression else per_position(logits, labels)
            if dense is not None:  # a segmentation's pixels: scored as positions, with no shift
                return language_model_holdout(*dense, shift=False)
            if logits.dim() == 3 and not self.regression:  # reduce each batch at once: [batch, seq, vocab] is large
                if self.token_input is not None and self.sees_future is None and not ranks.lockstep and not probe:
                    probe.append((batch, logits))  # probed below, once the activations are no longer watched
                if self.token_input is not None and not ranks.lockstep and not padding:
                    padding.append(self.padded_row(batch, logits, labels))
                mask = batch.get("attention_mask") if isinstance(batch, dict) else None
                return language_model_holdout(logits, labels, self.config.holdout_token_ids, self.shift,
                                              ahead=self.token_input is not None, attention_mask=mask)
            return logits, labels

        watch = _ActivationWatch(model) if self.config.track_activations and not ranks.lockstep else None
        probe: List[tuple] = []
        order: List[tuple] = []
        padding: List[Optional[tuple]] = []
        with _evaluating(model):
            with watch.watching() if watch is not None else contextlib.nullcontext():
                parts = ranks.over_batches("holdout", self.on(model, device), score)
            if probe:
                self.sees_future = self.future_probe(model, *probe[0])
            if order:
                self.eval_probe = self.order_probe(model, *order[0]) or {}
            padded = self.padding_probe(model, *padding[0]) if padding and padding[0] else None
        self.activations = watch.section() if watch is not None else None
        if parts is None:
            return None
        lm = [p for p in parts if isinstance(p, dict)]
        if lm:
            merged = merge_lm_holdout(lm)
            if self.sees_future is not None:
                merged["sees_future"] = self.sees_future
            merged.update(padded or {})
            return self._with_probe(merged)
        outputs, targets = torch.cat([p[0] for p in parts]), torch.cat([p[1].reshape(p[1].shape[0], -1) for p in parts])
        if self.regression or (self.graded and (outputs.dim() == 1 or outputs.shape[-1] == 1)):
            return self._with_probe(regression_holdout(outputs, targets))
        if self.label_range is not None and outputs.dim() == 2 and outputs.shape[-1] > 1:
            low, high = self.label_range
            if low < 0 or high >= outputs.shape[-1]:
                raise ValueError(f"the holdout's class labels run from {low} to {high}, but the model gives "
                                 f"{outputs.shape[-1]} outputs per example (classes 0 to {outputs.shape[-1] - 1}): "
                                 "its last layer has too few outputs, or the labels are not numbered from 0 "
                                 "(pass labels= that maps them to the model's classes)")
        so_far = self.probabilities if self.probabilities is not None else torch.ones((), dtype=torch.bool,
                                                                                        device=outputs.device)
        out = classification_holdout(outputs, targets.reshape(-1), so_far)
        self.probabilities = out.get("probabilities", self.probabilities)
        return self._with_probe(out)

    def _with_probe(self, section: Dict[str, Any]) -> Dict[str, Any]:
        if self.eval_probe:
            section["eval_probe"] = self.eval_probe
        return section


def sparse_quality(layout: _Layout, model: torch.nn.Module, holdout: _Holdout, batches: List[Any],
                   changes: Dict[str, Any], previous: str, current: str, config: TelemetryConfig,
                   step: int) -> Dict[str, Any]:
    """Holdout outputs of the full update against the update with only |dW| > t kept, per threshold,
    and against a random mask keeping the same share of each tensor (the baseline).

    The weights are overwritten in place chunk by chunk from the two references on disk (previous and
    current weights), never copied on the device; the current file restores them bit for bit.
    """
    counts = torch.tensor([p.numel() for p in layout.params], dtype=changes["l1"].dtype,
                          device=changes["below"].device)
    out: Dict[str, Any] = {}
    touched = False
    with _evaluating(model):
        try:
            full, valid = [], []
            for batch in batches:
                logits, labels = holdout.forward_one(model, batch)
                logits = logits.detach()
                full.append(logits)
                valid.append(_valid_positions(logits, labels, holdout.shift,
                                              batch.get("attention_mask") if isinstance(batch, dict) else None))
            for k, t in enumerate(config.sparse_quality_thresholds):
                dropped = changes["below"][changes["thresholds"].index(t)].to(counts.dtype)
                entry: Dict[str, Any] = {"kept_ratio": 1 - dropped.sum() / counts.sum().clamp(min=1)}
                touched = True
                _apply_sparse(layout, previous, current, threshold=t)
                entry.update(_agreement(model, holdout, batches, full, valid))
                keep = 1 - dropped / counts.clamp(min=1)
                _apply_sparse(layout, previous, current, keep=keep, seed=step * 1009 + k)
                entry["random"] = _agreement(model, holdout, batches, full, valid)
                out[threshold_key(t)] = entry
        finally:
            if touched:
                _overwrite_weights(layout.params, ((i, start, chunk.to(layout.params[i].device))
                                                   for i, start, chunk in stream_tensor_chunks(current, layout.names)))
    return out


def _apply_sparse(layout: _Layout, previous: str, current: str, threshold: Optional[float] = None,
                  keep: Optional[torch.Tensor] = None, seed: int = 0) -> None:
    """w <- where(mask, w_now, w_prev) for every trainable tensor: mask = |w_now - w_prev| > threshold,
    or (with keep) uniform < keep[i] from a private generator: the global RNG is not touched."""
    generators: Dict[Any, torch.Generator] = {}

    def chunks():
        for (i, start, now), (_, _, prev) in zip(stream_tensor_chunks(current, layout.names),
                                                 stream_tensor_chunks(previous, layout.names)):
            dev = layout.params[i].device
            now_d, prev_d = now.to(dev), prev.to(dev)
            if keep is None:
                mask = (now_d.float() - prev_d.float()).abs() > threshold
            else:
                gen = generators.get(dev)
                if gen is None:
                    gen = generators[dev] = torch.Generator(device=dev)
                    gen.manual_seed(seed)
                mask = torch.rand(now_d.shape, generator=gen, device=dev) < keep[i].to(dev)
            yield i, start, torch.where(mask, now_d, prev_d)

    _overwrite_weights(layout.params, chunks())


def _agreement(model, holdout: _Holdout, batches, full, valid) -> Dict[str, Any]:
    sums = None
    for batch, reference, ok in zip(batches, full, valid):
        logits, _ = holdout.forward_one(model, batch)
        part = logit_agreement(reference, logits, ok)
        sums = part if sums is None else {k: sums[k] + part[k] for k in part}
    positions = sums["positions"].clamp(min=1)
    return {"kl": (sums["kl"] / positions).clamp(min=0), "cosine": sums["cosine"] / positions,
            "mse": sums["sq"] / sums["elements"].clamp(min=1), "top1_agree": sums["agree"] / positions}


# ---- LoRA --------------------------------------------------------------------------------------------


@dataclass
class _LoraEntry:
    """One adapter of one LoRA module, with dW = scale * B @ A (see lora_factors)."""
    name: str
    module: torch.nn.Module
    adapter: str
    a: torch.Tensor
    b: torch.Tensor
    magnitude: Optional[torch.Tensor]  # DoRA's magnitude vector, or None

    @property
    def scale(self) -> Any:
        return self.module.scaling[self.adapter]


class _LoraTracker:
    """The `lora` section: the adapters found in the model (cached per layout), and the DoRA magnitude
    vectors as first seen, for their drift."""

    def __init__(self):
        self.found: Optional[tuple] = None  # (layout key, [_LoraEntry])
        self.dora_start: Dict[str, torch.Tensor] = {}

    def entries(self, model: torch.nn.Module, layout: _Layout) -> List[_LoraEntry]:
        if self.found is None or self.found[0] != layout.key:
            self.found = (layout.key, [_LoraEntry(name, module, adapter, *lora_factors(module, adapter),
                                                  dora_magnitude(module, adapter))
                                       for name, module, adapter in find_lora_modules(model)])
        return self.found[1]

    def section(self, model: torch.nn.Module, layout: _Layout, reference: _ReferenceStore, ranks: Any,
                step: int) -> Optional[Dict[str, Any]]:
        """Adapter norms and deltas against the reference the weight pass is about to replace."""
        found = self.entries(model, layout)
        if not found:
            return None  # no LoRA in this model: no section
        ranks.whole("the lora section")  # B @ A needs whole factors
        name_of = {id(p): n for n, p in zip(layout.names, layout.params)}
        stats = lora_stats([(e.name, e.a, e.b, e.scale) for e in found], self._previous(found, name_of, reference))
        mags = [(name_of.get(id(e.magnitude), f"{e.name}.{e.adapter}"), e.magnitude) for e in found
                if e.magnitude is not None]
        if mags:
            for key, m in mags:
                self.dora_start.setdefault(key, m.detach().float().clone())
            stats["dora_magnitude_drift"] = relative_drift([m for _, m in mags], [self.dora_start[k] for k, _ in mags])
        if not reference.config.keeps_reference:  # no full reference is written: keep one of the adapters
            ids = {id(t) for e in found for t in (e.a, e.b, e.magnitude) if t is not None}
            reference.write([(n, p) for n, p in zip(layout.names, layout.params) if id(p) in ids], step)
        return stats

    @staticmethod
    def _previous(found: List[_LoraEntry], name_of: Dict[int, str], reference: _ReferenceStore):
        """(A0, B0) of each LoRA module from the weight reference on disk, or None when it holds none.

        The reference is the one the weight pass keeps (trainable A and B are in it). A factor that is not
        trainable is not in it either: it cannot have changed, so the current tensor stands in. The header
        and the map are the ones the weight pass uses (kept from collection to collection while the file
        is as this process wrote it), not a fresh open, read and map of the file each time.
        """
        path = reference.checkpoint
        try:
            header = reference.headers.info(path)[0]
        except (OSError, ValueError):
            return None
        wanted = []
        for e in found:
            for p in (e.a, e.b):
                name = name_of.get(id(p))
                if name is None:
                    continue
                meta = header.get(name)
                if meta is None or meta["shape"] != list(p.shape) or meta["dtype"] != _DTYPE_CODES.get(p.dtype):
                    return None
                wanted.append(name)

        def pairs():
            stream = stream_tensor_file(path, wanted, mapper=reference.maps.map)
            try:
                for e in found:
                    # Views of the map, which lora_stats copies into its stacks at once, before the reference
                    # is rewritten (in weight_delta, after this section); from CPU memory, in one transfer.
                    yield tuple(next(stream) if id(p) in name_of else p for p in (e.a, e.b))
            finally:
                stream.close()
        return pairs()


# =====================================================================================================
# TrainingTelemetry: decides when to collect, calls the metrics, and does all the I/O
# =====================================================================================================


class TrainingTelemetry:
    """Collects gradient norms, weight deltas, learning rates, holdout predictions and batch balance.

    Call `on_batch_end` after `optimizer.step()` and before `zero_grad()`. Errors inside a metric are
    recorded in the record's `errors` and warned about once; training never sees them unless `strict`.
    Alerts (loss/gradient spikes, NaN/Inf, LR 0, frozen groups) are logged to logging.getLogger("telemetry")
    when they start and passed to `on_alert(alert)` (a constructor argument or attribute); what on_alert
    raises reaches the training loop, e.g. to stop it. `add_metric(name, fn)` records your own metrics.
    """

    def __init__(self, config: Optional[TelemetryConfig] = None, on_alert: Optional[Callable] = None,
                 **overrides: Any):
        if config is None or overrides:
            base = dataclasses.asdict(config) if config is not None else {}
            config = TelemetryConfig.from_dict({**base, **overrides})
        self.config = config
        self.step = 0
        # on_alert(alert) sees each new alert (a record's `alerts` entry plus "step").
        self.on_alert: Optional[Callable[[Dict[str, Any]], Any]] = on_alert
        self._warn = _Warnings()
        self._scaler = _GradScaler()  # the AMP scale the gradients still carry
        self._gradients = _Gradients(self._scaler)
        self._holdout = _Holdout(config)
        self._lora = _LoraTracker()
        self._alerts = _AlertMonitor(config)
        self._clock = _SystemClock()
        self._metrics: Dict[str, Callable] = {}  # add_metric: name -> fn(model, optimizer, context)
        self._layout: Optional[_Layout] = None  # rebuilt when the model, optimizer or trainable set change
        self._optimizer_lists: Dict[tuple, _Optimizers] = {}  # several optimizers passed as a list, kept as one
        self._passed: List[Any] = []  # weak references to the optimizers passed, the latest last
        self._last_passed = id(None)  # id() of the optimizer of the last call
        self._ranks: Any = _Replicated(*_rank_and_world(), "none")
        self._ranks_key: Any = None
        self._off = False  # the ranks disagree: telemetry is off on every rank
        # The step by which nothing collected is warned about: 10 * collect_every_n steps after the first this
        # process sees (a Trainer resumed from a checkpoint starts at its global step); -1 once one collected.
        self._silent_warn_step: Optional[int] = None
        self._closed = False
        self._hf_callback = None
        self._files: Optional[_RunFiles] = None
        self._reference: Optional[_ReferenceStore] = None
        if not config.enabled:
            return
        self._schedule = _Schedule(config.collect_every_n)  # when to collect: right after optimizer steps
        if config.output_dir is None:
            raise ValueError("output_dir: must be set (in the YAML, or TelemetryConfig(output_dir=...))")
        self._open(resolve_output_dir(config.output_dir))

    def _open(self, output_dir: str) -> None:
        """Take output_dir for this run: its files, its lock, its weight references."""
        self.output_dir = output_dir
        self.metrics_file = os.path.join(output_dir, RECORDS_FILE)
        self.run_file = os.path.join(output_dir, RUN_FILE)
        self._files = _RunFiles(output_dir, self.config, self._warn, _Mirrors(self.config, self._warn, output_dir))
        self._reference = _ReferenceStore(output_dir, self.config, self._files, self._warn)
        self.step = self._start_step = self._files.start(self.config)

    @property
    def checkpoint_file(self) -> str:
        """The weight reference this rank measures deltas against."""
        return self._reference.checkpoint

    @property
    def initial_file(self) -> str:
        return self._reference.initial

    # ---- public API --------------------------------------------------------------------------------

    def set_holdout_data(self, batches: Any, forward: Optional[Callable] = None,
                         labels: Optional[Callable] = None, output: Any = None) -> None:
        """Keep the first `holdout_size` examples of the holdout set, to score the model on at each collection.

        `batches`: a DataLoader or any iterable of batches, a map-style Dataset or a list of examples
        (collated here), or one batch. An (inputs..., labels) batch runs model(*inputs); a dict runs
        model(**batch without the label key). `forward(model, batch) -> outputs` and `labels(batch) -> tensor`
        override this, and `output` says where the predictions are in the outputs (an index, a key, or a
        callable) when the model returns several tensors. Float targets (other than 0/1) are regression, and so
        is one output per example against integer labels beyond 0/1.
        What cannot be used is refused here, with a ValueError that says what to pass.
        """
        examples = self._holdout.set(batches, forward, labels, output)
        if self._active():
            self._files.update_info(holdout={"examples": examples, **self._holdout.input_scale(),
                                             **self._holdout.input_pairs(), **self._holdout.token_entropy(),
                                             **self._holdout.reconstructs()})

    def on_batch_end(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                     batch_idx: int, epoch: int, device: Any = None, batch: Any = None, loss: Any = None,
                     **scalars: Any) -> Optional[Dict[str, Any]]:
        """The hook: call after optimizer.step(), before zero_grad(). Returns the record when it collects.

        Under torch.distributed call it on every rank, with the same batch_idx: rank 0 alone writes.
        """
        if not self.config.enabled:
            return None
        if self._closed:  # its directory and lock are let go: another TrainingTelemetry may write there now
            self._warn("closed", "telemetry: on_batch_end was called after close(); nothing is recorded")
            return None
        if device is not None and not isinstance(device, (str, int, torch.device)):
            raise TypeError(f"on_batch_end: device= got a {type(device).__name__}; {_HOOK_ORDER}: pass the batch as "
                            "batch=")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"on_batch_end: model= got a {type(model).__name__}, not a torch.nn.Module; {_HOOK_ORDER}")
        if isinstance(device, int):
            _check_device_index(device, _unwrap_model(model))
        loss = _hook_loss(loss)
        optimizer = _one_optimizer(optimizer, self._optimizer_lists)
        if id(optimizer) != self._last_passed:  # the same one as last time: every call of a plain loop
            self._check_turns(optimizer)
        taken = self._schedule.advance(optimizer, batch_idx)
        # A step the GradScaler skipped (inf/NaN gradients) is still a step of the loop, as the HF Trainer's and
        # Lightning's step counts have it: recorded, its gradients null and marked, raising no alert of its own.
        self._scaler.skipped_now = not taken and self._scaler.backed_off()
        taken = taken or int(self._scaler.skipped_now)
        self._scaler.track()
        if not taken:  # no optimizer step since the last call: a micro-batch of gradient accumulation
            if self._schedule.calls_without_step == 10 * self.config.collect_every_n + 100:
                self._warn("no-step", f"telemetry: on_batch_end was called {self._schedule.calls_without_step} "
                                      "times without an optimizer.step() in between. It collects only right after "
                                      "a step (micro-batches of gradient accumulation are skipped): call it after "
                                      "optimizer.step(), with that optimizer.")
            return None
        if self._silent_warn_step is None:
            self._silent_warn_step = self.step + 10 * self.config.collect_every_n
        self.step += taken
        if self._active() and self._reference.initial_pending:
            self._capture_initial(_unwrap_model(model), optimizer)
        if not self._schedule.take_due(batch_idx) or not self._active():
            if 0 < self._silent_warn_step <= self.step and self._active():
                here = self.step - self._silent_warn_step + 10 * self.config.collect_every_n
                self._warn("silent", f"telemetry: nothing collected in {here} steps: batch_idx never reached a "
                                     f"multiple of collect_every_n={self.config.collect_every_n}. Epochs shorter "
                                     "than that restart batch_idx before it gets there; lower collect_every_n.")
            return None
        try:
            with _one_cpu_thread():
                record = self._collect(_unwrap_model(model), optimizer, batch_idx, epoch, device, batch, loss,
                                       scalars)
        except Exception as exc:  # the training loop must never see telemetry fail
            self._alerts.take()
            if self.config.strict:
                raise
            self._warn("collect", f"telemetry: collection failed and was skipped: {exc!r}")
            return None
        # Outside the guard above: what on_alert raises (e.g. to stop training) reaches the loop.
        new = self._alerts.take()
        if self.on_alert is not None and record is not None:
            for alert in new:
                self.on_alert(dict(alert, step=record["step"]))
        return record

    def _check_turns(self, optimizer: Any) -> None:
        """Warn when optimizers are passed in turn (a GAN's on_batch_end after each of its two steps): each
        call sees its own optimizer's groups only, so the records alternate between them, steps count twice
        and every collection's weight delta restarts. An optimizer that replaces another for good (rebuilt
        after unfreezing) is not a turn: the old one never comes back, or is gone (weak references)."""
        self._last_passed = id(optimizer)
        if optimizer is None:
            return
        live = [r for r in self._passed if r() is not None]
        if any(r() is optimizer for r in live):
            if not self._files.info.get("optimizers_in_turn"):  # for the analyzer: the records alternate
                self._files.update_info(optimizers_in_turn=True)
            self._warn("turns", "telemetry: on_batch_end gets different optimizers in turn for one model; each "
                                "call sees only its optimizer's groups, so the records alternate between them and "
                                "the weight deltas restart at every collection. Call it once per step, after all "
                                "of them stepped, with them as a list: on_batch_end(model, [opt_a, opt_b], ...)")
        try:
            self._passed = [r for r in live if r() is not optimizer][-7:] + [weakref.ref(optimizer)]
        except TypeError:  # not weak-referenceable: not tracked
            pass

    def set_grad_scaler(self, scaler: Any) -> None:
        """Record a torch.amp.GradScaler's scale and skipped steps (`grad_scaler`), and keep gradient norms
        unscaled. Set once; every on_batch_end call then compares the scale with the one before (a skipped
        step backs it off), with tensor ops only."""
        self._scaler.set(scaler)

    def keep_initial_weights(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
        """Keep W_0, which drift is measured from, now: call it before the first optimizer step, and drift
        counts that step too. Otherwise the hook's first call keeps it, after the first step. The HF and
        Lightning callbacks call it when training begins; a run resumed on its directory keeps the W_0 it
        has."""
        if self.config.enabled and self._active() and self._reference.initial_pending:
            self._capture_initial(_unwrap_model(model), _one_optimizer(optimizer, self._optimizer_lists))

    def capture_gradients(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                          batch_idx: int, stepping: Optional[torch.optim.Optimizer] = None) -> bool:
        """Read the gradients now, before optimizer.step() and clipping, for the record that on_batch_end
        makes for this batch_idx. For code that runs before the step: Lightning's on_before_optimizer_step,
        or between DeepSpeed's engine.backward() and engine.step(). Still-scaled gradients (no
        scaler.unscale_ yet) are divided by the scale. Several optimizers that step in turn, each after a
        backward of its own: call it before each one's step with `stepping=` that one, and each tensor keeps
        the gradient its own optimizer stepped on. True when it read them."""
        if not self._active() or not self._schedule.will_collect(batch_idx) or not self.config.track_gradients:
            return False
        optimizer = _one_optimizer(optimizer, self._optimizer_lists)
        try:
            # For the next on_batch_end call only (it counts self.step up by one).
            self._gradients.capture(self._layout_for(_unwrap_model(model), optimizer), optimizer, self.step + 1,
                                    stepping)
            return True
        except Exception as exc:
            if self.config.strict:
                raise
            self._warn("capture", f"telemetry: reading gradients before the step failed ({exc!r}); "
                                  "on_batch_end reads them after it")
            return False

    def add_metric(self, name: str, fn: Callable[..., Dict[str, Any]]) -> None:
        """Record `fn(model, optimizer, context)` under `custom.<name>` at every collection.

        `context` is {"step", "batch_idx", "epoch", "batch", "loss"}; `fn` returns {str: number or tensor}
        (tensors are resolved with the record's one transfer). A failing metric is isolated like a built-in
        one: recorded in errors["custom.<name>"], warned about once, raised only when `strict`.
        """
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"add_metric: name must be a non-empty string without dots, got {name!r}")
        if not callable(fn):
            raise TypeError(f"add_metric: fn must be callable, got {type(fn).__name__}")
        self._metrics[name] = fn

    def lightning_callback(self) -> Any:
        """A lightning.pytorch Callback that feeds this telemetry: `Trainer(callbacks=[it])` (see
        lightning_callback_class for the hooks it uses)."""
        return lightning_callback_class()(self)

    def hf_callback(self) -> Any:
        """A transformers.TrainerCallback that feeds this telemetry: `Trainer(..., callbacks=[it])`.

        TRL's SFTTrainer and unsloth run transformers.Trainer's loop, so it serves them too. No other hook
        call is needed; see hf_callback_class for what it reads, and when.
        """
        if self._hf_callback is None:
            self._hf_callback = hf_callback_class()(self)
        return self._hf_callback

    def close(self) -> None:
        self._closed = True
        if self._files is not None:
            self._files.close(self.step)
            self._files.mirrors.close()
        if self._reference is not None:
            self._reference.maps.kept.clear()  # the maps of the reference files go with their last views

    def __enter__(self) -> "TrainingTelemetry":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- for the HF callback ------------------------------------------------------------------------

    def _active(self) -> bool:
        return self._files is not None and not self._files.stopped and not self._off and not self._closed

    def _capture_rows(self, model, optimizer, step: int, squares: Dict[int, torch.Tensor]) -> None:
        """capture_gradients for the record of `step` from squared norms read earlier ({id(parameter):
        ||grad||^2}): the HF callback's gradients before clipping."""
        try:
            layout = self._layout_for(_unwrap_model(model), optimizer)
            found = [squares.get(id(p)) for p in layout.params]
            if not any(v is not None for v in found):
                return
            device = next(v for v in found if v is not None).device
            sq = torch.stack([v.to(device) if v is not None else torch.zeros((), device=device) for v in found])
            has = torch.tensor([float(v is not None) for v in found])
            self._gradients.capture(layout, optimizer, step, rows=(sq.float(), has))
        except Exception as exc:
            if self.config.strict:
                raise
            self._warn("capture", f"telemetry: the gradients read before clipping could not be used ({exc!r}); "
                                  "the norms are those after clipping")

    def _collect_held(self, model, optimizer, global_step: int, epoch: int, batch: Any, loss: Any):
        """on_batch_end for optimizer step global_step + 1, its record held back until _release_held()."""
        self.step = global_step  # on_batch_end counts it up to this optimizer step
        with self._files.hold() if self._files is not None else contextlib.nullcontext():
            return self.on_batch_end(model, optimizer, global_step + 1, epoch, batch=batch, loss=loss)

    def _release_held(self) -> None:
        if self._files is not None:
            self._files.release()

    # ---- one collection ----------------------------------------------------------------------------

    def _collect(self, model, optimizer, batch_idx, epoch, device, batch, loss, scalars):
        cfg = self.config
        started = time.perf_counter()
        c = _Collection(_record_head(self.step, batch_idx, epoch, loss, scalars), started, cfg.strict,
                        self._warn, self._ranks.lockstep)
        if self._files.start_pending:  # the first record of this start: the analyzer's boundary
            c.record["start"], self._files.start_pending = self._files.start_index, False
        c.layout = c.run("layout", self._layout_for, model, optimizer)
        if not self._take_part(model, c.layout):
            return None  # DDP: rank 0 collects alone; or the ranks disagree (telemetry is off)
        c.lockstep = self._ranks.lockstep
        if c.layout is not None:
            self._parameter_sections(c, model, optimizer, device)
        c.add("eval_mode", eval_mode_modules, model)
        if self._scaler.active:
            c.add("grad_scaler", self._scaler.section)
        if cfg.track_holdout_logits and self._holdout.batches:
            c.add("holdout_logits", self._holdout.section, model, device, self._ranks)
            if self._holdout.activations:
                c.record["activations"] = self._holdout.activations
        if cfg.track_batch_stats and isinstance(batch, (torch.Tensor, collections.abc.Mapping, list, tuple)):
            c.add("batch_stats", batch_stats, batch, cfg.batch_label_key, self._holdout)
        elif cfg.track_batch_stats and batch is not None:
            self._warn("batch-type", f"telemetry: batch= is a {type(batch).__name__}, which batch_stats cannot read "
                                     "(it reads a tensor, a tuple or list, or a dict); pass batch=(inputs, labels) "
                                     "or a dict of tensors to count its labels")
        if cfg.track_system:
            c.add("system", self._clock.section, model, batch, started, self.step, self._schedule.batches_per_step)
        if self._metrics:
            context = {"step": self.step, "batch_idx": batch_idx, "epoch": epoch, "batch": batch, "loss": loss}
            given = list(optimizer.members) if isinstance(optimizer, _Optimizers) else optimizer  # as passed
            custom = {name: c.run(f"custom.{name}", custom_metric_values, fn, model, given, context)
                      for name, fn in list(self._metrics.items())}
            if any(v is not None for v in custom.values()):
                c.record["custom"] = {k: v for k, v in custom.items() if v is not None}
        if c.strict_error is not None:  # strict, in lockstep: raised once every rank is past the collectives
            raise c.strict_error
        c.record, nonfinite = host_record(c.record)
        stats = c.record.get("batch_stats")
        if isinstance(stats, dict) and "holdout_sums" in stats:
            stats["holdout_matches"], stats["holdout_checked"], stats["checked_pairs"] = \
                self._holdout.overlap(stats.pop("holdout_sums"))
        if c.layout is not None and c.layout.params:  # none held by the optimizer: "outside" said so
            _warn_about_gradients(c.record, self._warn)
        _null_ratios_of_zero_weights(c.record)
        if c.layout is not None and nonfinite:  # rare: one more pass names the culprits
            c.add("nonfinite_params", nonfinite_params, c.layout)
        if cfg.alerts:
            c.add("alerts", self._alerts.check, c.record, nonfinite)
        record = c.record
        record["telemetry_ms"] = self._clock.last_ms = (time.perf_counter() - started) * 1e3
        self._silent_warn_step = -1
        if nonfinite or _has_nonfinite(record.get("alerts")):  # rare: only then a second walk
            record, paths = replace_nonfinite(record)
            if paths:
                record["nonfinite"] = paths
        if c.errors:
            record["errors"] = c.errors
        self._files.append(record)
        self._after_collection()
        return record

    def _after_collection(self) -> None:
        """Compile the fused kernels this collection asked for (TELEMETRY_COMPILE=1), now, at its end: the one
        collection of the process that waits for the compiler."""
        _FUSED.start()
        failure = _FUSED.failure()
        if failure is not None:
            self._warn("compile", f"telemetry: the fused weight-pass kernel could not be compiled ({failure}); "
                                  "the eager ops serve instead (unset TELEMETRY_COMPILE to skip the attempt)")

    def _parameter_sections(self, c: _Collection, model, optimizer, device) -> None:
        """The sections read from the parameters, in the order their data needs: the lora section reads the
        reference that the weight pass then replaces; after the ranks' one reduction, the sections that
        read the weight pass."""
        cfg, layout, ranks = self.config, c.layout, self._ranks
        if cfg.track_gradients:
            c.add("gradient_norm", self._gradients.section, c, layout, optimizer, self.step, ranks)
            c.add("grads_never_zeroed", self._gradients.never_zeroed, layout, self.step)
            # Sharded gradients (FSDP, DeepSpeed) are made afresh by the reduction at the last micro-batch, whatever
            # came before it: their version counters say nothing of the accumulation.
            if self._ranks.kind in ("none", "ddp"):
                # A trainer's callback is called once a step, after all of its micro-batches (_clock.accumulation).
                c.add("accumulation", self._gradients.accumulation, layout,
                      self._schedule.micro_batches() * self._clock.accumulation)
        if cfg.track_lora:
            c.add("lora", self._lora.section, model, layout, self._reference, ranks, self.step)
        keep_previous = cfg.track_sparse_quality and bool(self._holdout.batches)
        if cfg.track_weight_delta:
            c.add("weight_delta", self._reference.measure, c, layout, ranks, keep_previous)
        elif cfg.keeps_reference:  # the same pass feeds update_ratio/drift/param_change: no key
            c.run("weight_delta", self._reference.measure, c, layout, ranks, keep_previous)
        if c.reference_step is not None:  # the deltas cover the steps since this one
            c.record["reference_step"] = c.reference_step
        if cfg.track_learning_rates and optimizer is not None:
            c.add("learning_rates", layout.learning_rates)
        if cfg.track_layer_stats:
            c.add("layer_stats", layer_stats_section, c, layout, ranks, cfg.layer_stats_by)
        ranks.finish(c)
        if c.grad_profile is not None:
            c.record["grad_profile"] = c.grad_profile
        if c.changes is not None:
            if cfg.track_update_ratio:
                c.add("update_ratio", update_ratio_section, layout, c.changes)
                c.add("drift", drift_section, layout, c.changes)
                c.add("weight_norm", weight_norm_section, layout, c.changes)
            if cfg.track_param_change:
                c.add("param_change", param_change_section, layout, c.changes, cfg)
        if cfg.track_sparse_quality:
            c.add("sparse_quality", self._sparse_quality, c, model, device)

    def _sparse_quality(self, c: _Collection, model, device) -> Optional[Dict[str, Any]]:
        self._ranks.whole("sparse_quality")  # it rewrites the weights from whole references
        if not self._holdout.batches:
            self._warn("sparse-holdout", "telemetry: track_sparse_quality needs holdout inputs "
                                         "(set_holdout_data); skipped")
            return None
        if c.previous_reference is None or c.changes is None or "below" not in c.changes:
            return None  # the first collection: no update to sparsify yet
        return sparse_quality(c.layout, model, self._holdout, self._holdout.on(model, device), c.changes,
                              c.previous_reference, self._reference.checkpoint, self.config, self.step)

    # ---- the layout and the ranks ------------------------------------------------------------------

    def _layout_for(self, model: torch.nn.Module, optimizer: Any) -> _Layout:
        if self._layout is None or self._layout.key != _layout_key(model, optimizer) \
                or self._layout.optimizer() is not optimizer:
            fingerprint = model_fingerprint(model)
            if self._layout is None and self._files.resumed and self._files.info.get("model") not in (None, fingerprint):
                self._move_on(fingerprint)
            before = self._layout
            self._layout, partitions = build_layout(model, optimizer, self.config)
            if before is not None and [id(p) for p in before.params] != [id(p) for p in self._layout.params]:
                self._alerts.measured_other_tensors()
                self._reference.trainable_changed = True
            info = layout_info(model, optimizer, self._layout, partitions)
            self._files.update_info(model=fingerprint, **info)
            unregistered = info.get("unregistered")
            if unregistered:
                said = "; ".join(f"{path} ({n} tensor(s), {elements:,} elements)"
                                 for path, (n, elements) in list(unregistered.items())[:4])
                self._warn("unregistered", f"telemetry: the model holds trainable tensors in a plain Python list, "
                                           f"tuple or dict: {said}. They get gradients but are no parameters of the "
                                           "model: an optimizer built from model.parameters() never steps them, "
                                           ".to() does not move them and state_dict() does not save them. Hold "
                                           "them in nn.ModuleList, nn.ModuleDict or nn.ParameterList (run.json "
                                           "lists them under unregistered).")
            if self._layout.outside:
                names = [n for n, _ in self._layout.outside]
                listed = f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
                if any(p.grad is not None for _, p in self._layout.outside):
                    self._warn("outside", f"telemetry: {len(names)} trainable tensor(s) are in no optimizer group "
                                          f"{listed}: nothing updates them and their gradients grow with every "
                                          "backward(). They are left out of the records (run.json lists them): add "
                                          "them to the optimizer, or freeze them. If another optimizer trains them, "
                                          "pass every optimizer, as a list.")
                elif not self._layout.params:  # no backward reaches any: not the model the loss is computed with
                    self._warn("outside", f"telemetry: {len(names)} trainable tensor(s) are in no optimizer group "
                                          f"{listed} and have no gradient: is this a copy of the model (an EMA or "
                                          "AveragedModel, one loaded again) rather than the one the optimizer "
                                          "trains? They are left out of the records (run.json lists them): pass "
                                          "on_batch_end the model the optimizer steps, or freeze them.")
                else:
                    self._warn("outside", f"telemetry: {len(names)} trainable tensor(s) are in no optimizer group "
                                          f"{listed} and have no gradient (unused in the forward, or detached from "
                                          "the loss): nothing updates them. They are left out of the records "
                                          "(run.json lists them): freeze them, or add them to the optimizer if the "
                                          "loss should reach them.")
            if self._layout.ignored:
                said = "; ".join(f"group {g}: {k}={v[0]:g} (it reads {v[1]}, which is {v[2]:g})"
                                 for g, keys in self._layout.ignored.items() for k, v in keys.items())
                self._warn("group-keys", f"telemetry: the optimizer never reads these param-group keys: {said}. "
                                         "Spell them as the optimizer does (run.json lists them under "
                                         "ignored_group_keys).")
            if self._layout.complex:
                names = [n for n, _ in self._layout.complex]
                self._warn("complex", f"telemetry: {len(names)} trainable tensor(s) are complex "
                                      f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}), which telemetry "
                                      "does not measure: they are left out of every norm and delta (run.json lists "
                                      "them under complex); the real tensors are recorded.")
            if self._layout.beyond:
                groups = sorted({g for g, _ in self._layout.beyond})
                if any(p.grad is not None for _, p in self._layout.beyond):
                    self._warn("beyond", f"telemetry: the optimizer steps {len(self._layout.beyond)} tensor(s) that "
                                         f"are not parameters of the model passed to on_batch_end (in group(s) "
                                         f"{', '.join(groups)}): they are left out of every norm and delta, which "
                                         "cover the model's tensors alone (run.json lists them under not_in_model). "
                                         "Pass a module that holds them all, e.g. nn.ModuleDict({'model': model, "
                                         "'loss': loss_module}).")
                else:  # no backward reaches them either: tensors the model held once
                    self._warn("beyond", f"telemetry: the optimizer steps {len(self._layout.beyond)} tensor(s) that "
                                         f"are not parameters of the model passed to on_batch_end and have no "
                                         f"gradient (in group(s) {', '.join(groups)}): tensors the model no longer "
                                         "holds, a weight tied or replaced after the optimizer was built. They are "
                                         "left out of the records (run.json lists them under not_in_model); build "
                                         "the optimizer after the model is complete.")
        return self._layout

    def _move_on(self, fingerprint: str) -> None:
        """Another model's run is in output_dir: this run goes to a directory of its own, never mixed in: the
        first output_dir-N that holds this model's run (it resumes there), else the first free one."""
        old, n = self.output_dir, 2
        while os.path.lexists(f"{old}-{n}") and _run_model(f"{old}-{n}") != fingerprint:
            n += 1
        self._files.abandon()
        taken = self.step - self._start_step  # this run's steps so far: they count in the new directory too
        self._open(f"{old}-{n}")
        self.step += taken
        self._warn("other-model", f"telemetry: {old} holds the run of another model (other parameter names or "
                                  f"shapes); this run {'resumes in' if self._files.resumed else 'writes to'} "
                                  f"{self.output_dir} instead")

    def _take_part(self, model: torch.nn.Module, layout: Optional[_Layout], agree: bool = True) -> bool:
        """Find how the parameters are held (once per layout and process group); True when this rank
        collects. Sharded ranks first check, once, that they will all start the same collectives."""
        rank, world = _rank_and_world()
        params = layout.params if layout is not None else [p for p in model.parameters() if p.requires_grad]
        key = (layout.key if layout is not None else id(model), rank, world)
        if key != self._ranks_key:
            self._ranks_key, self._ranks = key, _ranks_for(model, params, rank, world)
            self._files.writer, self._files.lockstep = rank == 0, self._ranks.lockstep
            self._reference.suffix = self._ranks.suffix
            info = {"world_size": world, "rank": rank, "parallelism": self._ranks.kind}
            if any(self._files.info.get(k) != v for k, v in info.items()):
                self._files.update_info(**info)
        if self._ranks.kind == "fsdp1":
            self._warn("fsdp1", "telemetry: FSDP1 (FullyShardedDataParallel) is not supported: its flat "
                                "shards hide the parameters. Use FSDP2's fully_shard; nothing is recorded")
            return False
        if not agree:
            return self._ranks.keeps_reference
        if self._ranks.collects(lambda: self._probe(layout)):
            return True
        if self._ranks.disagree:
            self._off = True
            message = ("telemetry: the ranks differ in config, trainable parameters or holdout data (call "
                       "set_holdout_data on every rank); telemetry is off on every rank")
            if self.config.strict:
                raise RuntimeError(message)
            self._warn("ranks-differ", message)
        return False

    def _probe(self, layout: Optional[_Layout]) -> str:
        """What every rank must agree on before they start the same collectives."""
        config = {k: v for k, v in dataclasses.asdict(self.config).items() if k != "output_dir"}
        return json.dumps([config, len(layout.params) if layout is not None else None, self._ranks.kind,
                           self._holdout.sizes()], sort_keys=True, default=str)

    def _capture_initial(self, model, optimizer) -> None:
        # W_0 at the hook's first call (after the first step), not at the first collection 200 steps on.
        self._reference.initial_pending = False
        try:
            layout = self._layout_for(model, optimizer)
            if self._take_part(model, layout, agree=False):  # DDP: rank 0 alone keeps it
                self._reference.initial_for(layout.local_named(), self.step)
        except Exception as exc:
            if self.config.strict:
                raise
            self._warn("initial", f"telemetry: could not keep the initial weights ({exc!r}); drift is "
                                  "measured from the first collection")


# =====================================================================================================
# Integrations: built on first use, so that this module imports with torch alone
# =====================================================================================================


_LAZY_CLASSES: Dict[str, type] = {}


def _record_clipping(telemetry: Any, max_norm: Any) -> None:
    """run.json's clip_grad_norm: the total norm a trainer clips each step's gradients to (the HF Trainer's
    max_grad_norm, Lightning's gradient_clip_val), where it clips; the records' norms are taken before it."""
    if isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool) and max_norm > 0 \
            and math.isfinite(max_norm) and telemetry._active():
        telemetry._files.update_info(clip_grad_norm=float(max_norm))


def hf_callback_class() -> type:
    """The transformers.TrainerCallback subclass behind TrainingTelemetry.hf_callback(), made on first use."""
    if "hf" in _LAZY_CLASSES:
        return _LAZY_CLASSES["hf"]
    from transformers import TrainerCallback  # lazy: only HF Trainer users need transformers

    class TelemetryCallback(TrainerCallback):
        """Feeds a TrainingTelemetry from transformers.Trainer (and TRL's and unsloth's trainers on top of it).

        The Trainer's order for one optimizer step: forward and backward of each micro-batch, clipping,
        on_pre_optimizer_step, optimizer.step(), on_optimizer_step, scheduler step, zero_grad, global_step
        += 1, on_step_end, then on_log with that step's pre-clip `grad_norm`. Hence:
        - it collects in on_optimizer_step, where the gradients (after clipping) are still there, the
          weights are updated and every group's lr is the one this step used. Never in on_step_end: the
          gradients are gone by then;
        - with clipping (max_grad_norm > 0, the default) the norms are read before it: on a step that will
          collect, a hook on each trainable tensor takes its gradient's squared norm once backward() has
          accumulated it, the last micro-batch's reading being the step's. The hooks are there for that step
          only: other steps' backward passes call no Python. Not in a distributed run (DDP
          averages the gradients after these hooks) nor with fp16's GradScaler (still scaled there): then
          the norms are those after clipping, which the optimizer stepped on;
        - it holds that record back until the Trainer logs the same step, and adds the logged pre-clip
          `grad_norm` (and the logged `loss`) as the `trainer` section. When the Trainer does not log that
          step the record is written, without `trainer`, at the next step or at the end of training;
        - steps are optimizer steps (state.global_step), never micro-batches: collect_every_n counts them;
        - hooks on the model see each training micro-batch by reference (batch_stats comes from the step's
          last micro-batch) and its outputs.loss (averaged over the step's micro-batches, or summed when
          the Trainer normalised them by num_items_in_batch), so no user code is needed.
        """

        def __init__(self, telemetry: "TrainingTelemetry"):
            self.telemetry = telemetry
            self._handles: List[Any] = []
            self._batch: Any = None
            self._losses: List[torch.Tensor] = []
            self._loss_is_sum = False
            self._pending: Optional[Dict[str, Any]] = None
            self._epoch = 0
            self._grad_hooks: List[Any] = []  # on the trainable tensors while a collecting step runs
            self._before_clip = False  # the norms can be read before clipping (see the class docstring)
            self._pre_clip: Dict[int, torch.Tensor] = {}  # id(parameter) -> ||grad||^2 before clipping

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            self._detach()
            self._before_clip = False
            if model is not None and self.telemetry._active():
                self._handles = [model.register_forward_pre_hook(self._see_batch, with_kwargs=True),
                                 model.register_forward_hook(self._see_output, with_kwargs=True)]
                if optimizer is not None:  # drift from the weights before the first step
                    self.telemetry.keep_initial_weights(model, optimizer)
                # the hook runs once an optimizer step, after the last of its micro-batches
                self.telemetry._clock.accumulation = max(int(getattr(args, "gradient_accumulation_steps", 1) or 1), 1)
                self._before_clip = bool(args.max_grad_norm and args.max_grad_norm > 0) and \
                    getattr(optimizer, "scaler", None) is None and _rank_and_world()[1] == 1
                _record_clipping(self.telemetry, args.max_grad_norm)

        def on_epoch_begin(self, args, state, control, **kwargs):
            self._epoch = int(state.epoch or 0)

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            self._release()
            self._losses = []
            self._pre_clip = {}
            self._drop_grad_hooks()
            if self._before_clip and model is not None and self.telemetry._active() and \
                    self.telemetry._schedule.will_collect(state.global_step + 1):
                self._grad_hooks = [p.register_post_accumulate_grad_hook(self._see_gradient)
                                    for p in model.parameters() if p.requires_grad]

        def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            self._release()
            self._drop_grad_hooks()
            if self._pre_clip:  # read by the hooks of this collecting step
                self.telemetry._capture_rows(model, optimizer, state.global_step + 1, self._pre_clip)
            self._pre_clip = {}
            self._pending = self.telemetry._collect_held(model, optimizer, state.global_step, self._epoch,
                                                         self._batch, self._step_loss())
            self._losses = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            record = self._pending
            if record is None or not logs or "grad_norm" not in logs or record["step"] != state.global_step:
                return
            trainer = {}
            for key in ("grad_norm", "loss"):
                value = logs.get(key)
                if isinstance(value, (int, float, torch.Tensor)):
                    value = float(value)
                    if not math.isfinite(value):
                        record.setdefault("nonfinite", []).append(f"trainer.{key}")
                        value = None
                    trainer[key] = value
            record["trainer"] = trainer
            self._release()

        def on_train_end(self, args, state, control, **kwargs):
            self._release()
            self._detach()
            self.telemetry.close()

        def _release(self):
            self._pending = None
            self.telemetry._release_held()

        def _detach(self):
            self._drop_grad_hooks()
            for handle in self._handles:
                handle.remove()
            self._handles = []

        def _drop_grad_hooks(self):
            for handle in self._grad_hooks:
                handle.remove()
            self._grad_hooks = []

        def _see_gradient(self, parameter):
            if parameter.grad is not None:
                self._pre_clip[id(parameter)] = per_tensor_sq_norms([_dense(parameter.grad.detach())])[0]

        def _see_batch(self, module, args, kwargs):
            if module.training and torch.is_grad_enabled():  # not the holdout's or evaluate()'s forwards
                self._batch = kwargs if kwargs else (args[0] if len(args) == 1 else args)

        def _see_output(self, module, args, kwargs, output):
            if module.training and torch.is_grad_enabled():
                loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
                if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                    self._losses.append(loss.detach().reshape(()))
                    self._loss_is_sum = "num_items_in_batch" in kwargs

        def _step_loss(self):
            if not self._losses:
                return None
            total = torch.stack([t.to(self._losses[0].device) for t in self._losses]).float().sum()
            return total if self._loss_is_sum else total / len(self._losses)

    _LAZY_CLASSES["hf"] = TelemetryCallback
    return TelemetryCallback


@contextlib.contextmanager
def _lrs_as_used(used: List[tuple]):
    """Each (param group, lr) of `used` put back into its group for the time of a collection, then the lr the
    scheduler has set since: the record holds the lr the step used, and the training goes on with its own."""
    now = [(g, g["lr"]) for g, _ in used]
    try:
        for g, lr in used:
            g["lr"] = lr
        yield
    finally:
        for g, lr in reversed(now):
            g["lr"] = lr


def lightning_callback_class() -> type:
    """The lightning.pytorch Callback behind TrainingTelemetry.lightning_callback(), made on first use."""
    if "lightning" in _LAZY_CLASSES:
        return _LAZY_CLASSES["lightning"]
    try:
        from lightning.pytorch import Callback  # lazy: only Lightning users need it
    except ImportError:
        from pytorch_lightning import Callback  # the package's older name

    class TelemetryCallback(Callback):
        """Feeds a TrainingTelemetry from a Lightning Trainer (automatic optimization, one optimizer).

        Lightning's order for one batch: zero_grad (inside the step's closure, before training_step),
        training_step, backward, [AMP: scaler.unscale_], on_before_optimizer_step, gradient clipping,
        optimizer.step(), [scaler.update()], on_train_batch_end. Hence:
        - gradients are read in on_before_optimizer_step (capture_gradients): unscaled and before clipping,
          the norm lightning.pytorch.utilities.grad_norm reports there;
        - the record is made in on_train_batch_end: the weights are updated (the delta includes this step).
          Lightning has stepped the lr scheduler by then, so every group's lr is read in
          on_before_optimizer_step, and recorded as the lr this step used;
        - batch_idx is Lightning's, per epoch: collect_every_n counts batches. With accumulate_grad_batches
          > 1, only batches that end an optimizer step are collected (whole gradients), and the loss is the
          mean of the step's micro-batch losses (Lightning divides each by accumulate_grad_batches, even at
          an epoch's last step, which may hold fewer);
        - in manual optimization, each optimizer's tensors keep the gradients read before its own step (a
          GAN's two backward()s);
        - the scalars logged with self.log (trainer.callback_metrics: train accuracy, say) go with the loss;
        - 16-mixed precision's GradScaler is picked up in on_fit_start (the grad_scaler section).
        Under DDP the callback runs on every rank and rank 0 writes; under FSDP2 (ModelParallelStrategy)
        every rank takes part, as on_batch_end requires.
        """

        def __init__(self, telemetry: "TrainingTelemetry"):
            self.telemetry = telemetry
            self._batch_idx = 0
            self._used_lrs: List[tuple] = []  # (param group, its lr when the optimizer stepped)
            self._loss: Optional[torch.Tensor] = None  # the micro-batch losses since the last step, added up
            self._micro = 0  # how many

        def on_fit_start(self, trainer, pl_module):
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            if scaler is not None:
                self.telemetry.set_grad_scaler(scaler)

        def on_train_start(self, trainer, pl_module):  # the optimizers exist; no step yet
            self.telemetry.keep_initial_weights(pl_module, self._optimizer(trainer))
            if str(getattr(trainer, "gradient_clip_algorithm", None) or "norm").endswith("norm"):
                _record_clipping(self.telemetry, getattr(trainer, "gradient_clip_val", None))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._batch_idx = batch_idx

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self._used_lrs += [(g, g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"])
                               for g in getattr(optimizer, "param_groups", ())]
            self.telemetry.capture_gradients(pl_module, self._optimizer(trainer), self._batch_idx,
                                             stepping=optimizer)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            loss = loss.detach() if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None
            if pl_module.automatic_optimization and loss is not None:
                self._loss = loss if self._loss is None else self._loss + loss
                self._micro += 1
                loss = self._loss * (trainer.accumulate_grad_batches / self._micro)
            stepped, self._used_lrs = self._used_lrs, []
            if stepped:
                self._loss, self._micro = None, 0
            with _lrs_as_used(stepped):
                self.telemetry.on_batch_end(pl_module, self._optimizer(trainer), batch_idx, trainer.current_epoch,
                                            device=pl_module.device, batch=batch, loss=loss,
                                            **self._logged(trainer))

        @staticmethod
        def _logged(trainer):
            """What self.log recorded (train accuracy, say), as scalars beside the loss."""
            out = {}
            for key, value in trainer.callback_metrics.items():
                if isinstance(value, torch.Tensor) and value.numel() == 1:
                    value = value.detach().reshape(())
                if isinstance(value, (torch.Tensor, int, float)) and not isinstance(value, bool) and \
                        key not in _RECORD_HEAD and key not in _SECTION_KEYS:
                    out[str(key)] = value
            return out

        def on_fit_end(self, trainer, pl_module):
            self.telemetry.close()

        @staticmethod
        def _optimizer(trainer):
            # The unwrapped optimizers, as the GradScaler keys its per-optimizer state by them; several (manual
            # optimization) go as a list.
            optimizers = list(trainer.optimizers)
            return optimizers[0] if len(optimizers) == 1 else optimizers or None

    _LAZY_CLASSES["lightning"] = TelemetryCallback
    return TelemetryCallback


# =====================================================================================================
# Command line: python telemetry.py --write-config telemetry.yaml
# =====================================================================================================

# The documented config file, top to bottom: a (key, why) pair per TelemetryConfig field, or a comment line.
# Kept beside the writer so the file exists wherever this module was copied; tests hold it to the dataclass.
_CONFIG_DOC = (
    ("enabled", "false: on_batch_end returns at once and nothing is written"),
    ("collect_every_n", "collect at the first optimizer step at or after each batch_idx that is a multiple\n"
                        "(TelemetryConfig() says 200, for long runs; 10 here, so a first run shows detail)"),
    ("output_dir", "run directory, set here or by the script; {date} and {host} make one per run"),
    "",
    ("track_gradients", "gradient L2 norm, overall and per group (null if gradients were zeroed)"),
    ("track_weight_delta", "L2 change of trainable weights since the last collection, via a file on disk"),
    ("track_learning_rates", "current lr of every optimizer param group, after the scheduler stepped"),
    ("track_holdout_logits", "predictions on the fixed holdout set given to set_holdout_data"),
    ("track_activations", "dead ReLU / saturated sigmoid and tanh units, seen only in the holdout's forward"),
    ("track_batch_stats", "label balance of the batch passed to on_batch_end"),
    "",
    ("holdout_size", "holdout examples (not batches) to keep"),
    ("groups", "{name: [patterns]} to group parameters by name; null = optimizer groups"),
    ("batch_label_key", "label key in dict batches; null = the first of " + ", ".join(LABEL_KEYS)),
    ("strict", "true: raise metric errors instead of recording them under \"errors\""),
    "",
    "# LoRA and language models.",
    ("track_lora", "with LoRA modules (peft/unsloth): the `lora` section and lora_A/lora_B/other groups"),
    ("holdout_token_ids", "[ids]: LM holdout also logs these tokens' logits where each answer starts"),
    "",
    "# Training dynamics. `preset: minimal | default | comprehensive` (a key of its own) applies a preset",
    "# first; the keys written here then override it.",
    ("track_layer_stats", "per-layer gradient norm/mean/std/min/max, zero/NaN/Inf counts, weight norm"),
    ("layer_stats_by", "layer (block index or module name) | group | tensor: the rows of layer_stats"),
    ("track_update_ratio", "||dW||/||W|| (~1e-3 is healthy), drift ||W - W_0|| and ||W|| per group; cheap"),
    ("track_param_change", "L1/L2/max/mean/std, sparsity and sign flips of the delta, per layer/component"),
    ("param_change_thresholds", "|dW| <= t counts as unchanged"),
    ("param_change_rel_thresholds", "|dW| <= t * |W|: scale-free (bf16-safe) sparsity"),
    ("track_sparse_quality", "holdout outputs with only |dW| > t applied vs the full update (costly)"),
    ("sparse_quality_thresholds", "the t of sparse_quality, one entry each"),
    ("track_system", "step time, examples/tokens per second, RSS, CUDA memory, GPU utilisation"),
    ("alerts", "loss/gradient spikes, NaN/Inf, LR 0, frozen groups: logged once when they start"),
    ("alert_window", "records in the rolling median/MAD window that spikes are judged against"),
    ("alert_spike_threshold", "robust z-score (MADs above the rolling median) that makes a spike"),
    ("alert_explosion_factor", "a gradient spike this many times its rolling median: a gradient explosion"),
    "",
    "# Mirrors: each record's numbers also go to the active wandb run and/or a TensorBoard SummaryWriter in",
    "# output_dir/tb (keys like telemetry/gradient_norm/head). telemetry.jsonl stays the source of truth.",
    ("mirror", "[wandb, tensorboard]"),
)
# Where the written file differs from TelemetryConfig() on purpose (its comment says why).
CONFIG_FILE_OVERRIDES = {"collect_every_n": 10}
_CONFIG_HEADER = """\
# Telemetry config: every key of TelemetryConfig, each with what it does.
# Written by `python telemetry.py --write-config telemetry.yaml`; read (with pyyaml) by
# TelemetryConfig.from_yaml("telemetry.yaml", output_dir="runs/exp1"), where keyword arguments win.
# An unknown key is an error that names it (and suggests the closest valid key).
telemetry:
"""
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "none", "~"}


def yaml_value(value: Any) -> str:
    """One config value as YAML flow text, without a YAML library. Floats always carry a '.' and a signed
    exponent, as YAML 1.1 readers (pyyaml) otherwise read 1e-08 as a string."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _yaml_float(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{yaml_value(str(k))}: {yaml_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    plain = text.replace("_", "a").replace("-", "a").replace(".", "a").isalnum() and text[0].isalpha()
    return text if plain and text.lower() not in _YAML_WORDS else json.dumps(text)


def _yaml_float(value: float) -> str:
    # Small thresholds read best as 1.0e-4: the shortest mantissa that still gives the same float back.
    if value == 0 or abs(value) >= 0.1:
        text = repr(value)
    else:
        text = next(t for p in range(1, 18) if float(t := f"{value:.{p}e}") == value)
        text = text.rstrip("0").replace(".e", ".0e")
    mantissa, _, exponent = text.partition("e")
    mantissa += "" if "." in mantissa else ".0"
    return mantissa + (f"e{int(exponent):+d}" if exponent else "")


def default_config_yaml() -> str:
    """The text of the documented default config file (the shipped telemetry.yaml is exactly this)."""
    config = TelemetryConfig(**CONFIG_FILE_OVERRIDES)
    lines = [_CONFIG_HEADER.rstrip("\n")]
    for entry in _CONFIG_DOC:
        if isinstance(entry, str):
            lines.append(f"  {entry}".rstrip())
            continue
        key, why = entry
        setting = f"  {key}: {yaml_value(getattr(config, key))}"
        first, *more = why.split("\n")
        lines.append(f"{setting.ljust(30)}{'  ' if len(setting) >= 30 else ''}# {first}")
        lines.extend(" " * 30 + f"# {line}" for line in more)
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    """`python telemetry.py --write-config PATH`: the config file, for a project that copied this file alone."""
    import argparse

    parser = argparse.ArgumentParser(prog="python telemetry.py", description=main.__doc__.split(":", 1)[1])
    parser.add_argument("--write-config", metavar="PATH", required=True,
                        help="write the documented default config to PATH ('-': standard output)")
    parser.add_argument("--force", action="store_true", help="replace PATH if it exists")
    args = parser.parse_args(argv)
    text = default_config_yaml()
    if args.write_config == "-":
        sys.stdout.write(text)
        return 0
    if os.path.exists(args.write_config) and not args.force:
        print(f"telemetry.py: {args.write_config} exists; --force replaces it", file=sys.stderr)
        return 1
    with open(args.write_config, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.write_config}; load it with TelemetryConfig.from_yaml({json.dumps(args.write_config)}, "
          "output_dir=\"runs/exp1\") (needs pyyaml)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
