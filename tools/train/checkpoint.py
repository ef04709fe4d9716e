"""Training checkpoints that let one training run continue the last, and the step-based learning-rate schedule.

A checkpoint holds everything a run needs to continue: both models' weights, the optimizer's state, the global
step and the schedule, the random generators, the data cursor, the accumulated token counts (for the draft
vocabulary) and the summaries of every run so far. Two forms:

* exact (`train_state.pt`): f32 weights and the whole AdamW state. Resuming from it continues bit for bit (the
  unit test checks N steps == N/2 + resume + N/2). It stays where it was written (about 12 bytes a parameter).
* compact (`resume.pt`, the one that travels between machines): bf16 weights, and of AdamW's state only the
  second moment, as the 8-bit logarithm of its square root. The first moment averages the last ~10 gradients
  (beta1 0.9) and is rebuilt within the first steps, starting from zero (its bias correction is not replayed, so
  the first updates are smaller: a soft re-warm-up). The second moment sets every parameter's step size, so it
  is kept: 3 bytes a parameter in all, about 57 MiB for the largest drafter that fits the export's size cap.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import torch

FORMAT = "dflash-train-state"
VERSION = 2
LOG_LEVELS = 255  # uint8 code 0 means "exactly zero"; 1..255 span [lo, hi] of log2(sqrt(v))


# ---------------------------------------------------------------------------------------------- schedule


def schedule_config(kind: str, total_steps: int, warmup_steps: int, decay_frac: float, peak_lr: float,
                    min_lr_ratio: float) -> dict:
    if kind not in ("wsd", "cosine"):
        raise ValueError(f"schedule {kind!r}: expected wsd or cosine")
    if total_steps <= warmup_steps:
        raise ValueError(f"total steps {total_steps} must exceed the warm-up's {warmup_steps}")
    return {"kind": kind, "total_steps": total_steps, "warmup_steps": warmup_steps, "decay_frac": decay_frac,
            "peak_lr": peak_lr, "min_lr_ratio": min_lr_ratio}


def lr_at(step: int, sched: dict) -> float:
    """The learning rate of global step `step` (0-based) over the whole multi-run budget.

    Linear warm-up over warmup_steps, then either cosine down to min_lr_ratio * peak at total_steps, or
    warm-up-stable-decay ('wsd'): the peak until the last decay_frac of the budget, then linear down to the
    floor. Past total_steps the floor. Only the step counts, never the clock, so any run split resumes exactly.
    """
    peak, floor = sched["peak_lr"], sched["peak_lr"] * sched["min_lr_ratio"]
    warm, total = sched["warmup_steps"], sched["total_steps"]
    if step < warm:
        return peak * (step + 1) / warm
    if step >= total:
        return floor
    if sched["kind"] == "cosine":
        t = (step - warm) / max(1, total - warm)
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * t))
    decay_start = total - int(round(sched["decay_frac"] * total))
    if step < decay_start:
        return peak
    return peak + (floor - peak) * (step - decay_start) / max(1, total - decay_start)


# ---------------------------------------------------------------------------------------------- rng


def rng_state(anchor_generator: torch.Generator) -> dict:
    return {"anchors": anchor_generator.get_state(), "torch": torch.get_rng_state(),
            "python": random.getstate(), "numpy": np.random.get_state()}


def restore_rng(state: dict, anchor_generator: torch.Generator) -> None:
    try:
        anchor_generator.set_state(state["anchors"])
    except (RuntimeError, ValueError):
        pass  # written on another kind of device (a CUDA run resumed on a CPU): that stream starts from its seed
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


# ---------------------------------------------------------------------------------------------- compact moments


def quantize_second_moment(v: torch.Tensor) -> dict:
    """v >= 0 as uint8 codes of log2(sqrt(v)) over the tensor's [lo, hi] (code 0 = exactly zero): a relative
    error of at most half a level (here < 3 % for a range of 20 octaves)."""
    root = v.detach().float().sqrt().cpu().flatten()
    positive = root > 0
    if not bool(positive.any()):
        return {"codes": torch.zeros(root.shape, dtype=torch.uint8), "lo": 0.0, "hi": 0.0, "shape": list(v.shape)}
    logs = torch.log2(root[positive])
    lo, hi = float(logs.min()), float(logs.max())
    span = max(hi - lo, 1e-12)
    codes = torch.zeros(root.shape, dtype=torch.uint8)
    codes[positive] = (1 + torch.round((logs - lo) / span * (LOG_LEVELS - 1))).to(torch.uint8)
    return {"codes": codes, "lo": lo, "hi": hi, "shape": list(v.shape)}


def dequantize_second_moment(packed: dict) -> torch.Tensor:
    codes = packed["codes"].to(torch.float32)
    span = packed["hi"] - packed["lo"]
    root = torch.exp2(packed["lo"] + (codes - 1) / (LOG_LEVELS - 1) * span)
    root = torch.where(codes > 0, root, torch.zeros_like(root))
    return (root * root).view(packed["shape"])


def compact_optimizer(optimizer: torch.optim.Optimizer, names: list[str]) -> dict:
    """{'step': int, 'second_moment': {name: packed}} from an AdamW whose params are named by `names` (in
    param_groups order)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    out, step = {}, 0
    for name, p in zip(names, params, strict=True):
        st = optimizer.state.get(p)
        if st:
            out[name] = quantize_second_moment(st["exp_avg_sq"])
            step = int(float(st["step"]))
    return {"step": step, "second_moment": out}


def load_compact_optimizer(optimizer: torch.optim.Optimizer, names: list[str], packed: dict) -> None:
    """Seeds AdamW's state: the stored second moment, a zero first moment, the stored step (bias correction)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    fused = bool(optimizer.defaults.get("fused"))  # the fused kernels keep the step counter on the device
    for name, p in zip(names, params, strict=True):
        if name not in packed["second_moment"]:
            continue
        v = dequantize_second_moment(packed["second_moment"][name]).to(p.device, p.dtype)
        step = torch.tensor(float(packed["step"]), device=p.device if fused else "cpu")
        optimizer.state[p] = {"step": step, "exp_avg": torch.zeros_like(p), "exp_avg_sq": v}


# ---------------------------------------------------------------------------------------------- files


def save(path: Path, state: dict, compact: bool) -> int:
    """Writes `state` (see trainer.Trainer.checkpoint) as an exact or a compact checkpoint; returns its bytes.

    state['optimizer'] is the live optimizer and state['param_names'] its parameters' names; both models'
    weights are f32 state dicts."""
    out = {k: v for k, v in state.items() if k not in ("optimizer", "param_names")}
    out.update(format=FORMAT, version=VERSION, kind="compact" if compact else "exact")
    if compact:
        out["drafter_state"] = _to_bf16(state["drafter_state"])
        out["mtp_state"] = None if state["mtp_state"] is None else _to_bf16(state["mtp_state"])
        out["optimizer"] = compact_optimizer(state["optimizer"], state["param_names"])
    else:
        out["optimizer"] = state["optimizer"].state_dict()
    out["param_names"] = state["param_names"]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(out, tmp)
    tmp.replace(path)  # a run killed while writing leaves the previous checkpoint intact
    return path.stat().st_size


def load(path: Path) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: not a training checkpoint of this format ({state.get('format')!r})")
    return state


def restore_optimizer(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Loads the optimizer part of an exact or compact checkpoint into a freshly built optimizer."""
    if state["kind"] == "exact":
        optimizer.load_state_dict(state["optimizer"])
    else:
        load_compact_optimizer(optimizer, state["param_names"], state["optimizer"])


def _to_bf16(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16).cpu() for k, v in weights.items()}


def compact_bytes_estimate(params: int) -> int:
    """Bytes of a compact checkpoint for `params` parameters, without the small metadata."""
    return 3 * params
