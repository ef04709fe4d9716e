"""Training data: the generated samples, a held-out split by prompt, and length-bucketed batches."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass
class Samples:
    sequences: list[np.ndarray]  # prompt + response token ids
    prompt_len: np.ndarray
    temperature: np.ndarray
    prompt_ids: list[str]
    info: dict

    def __len__(self) -> int:
        return len(self.sequences)


def load_samples(path: Path) -> Samples:
    data = np.load(path)
    offsets = data["offsets"]
    tokens = data["tokens"].astype(np.int64)
    sequences = [tokens[offsets[i]: offsets[i + 1]] for i in range(len(offsets) - 1)]
    info = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    return Samples(sequences, data["prompt_len"], data["temperature"], info["prompt_ids"], info)


def split_by_prompt(samples: Samples, eval_frac: float, min_eval: int = 1) -> tuple[list[int], list[int]]:
    """(train, eval) sample indices; all samples of one prompt fall on the same side (hash of the prompt id)."""
    def bucket(prompt_id: str) -> float:
        return int(hashlib.sha256(prompt_id.encode()).hexdigest()[:8], 16) / 16**8

    usable = [i for i in range(len(samples)) if len(samples.sequences[i]) > samples.prompt_len[i] + 1]
    evals = [i for i in usable if bucket(samples.prompt_ids[i]) < eval_frac]
    if len(evals) < min_eval and len(usable) > min_eval:
        # Tiny runs: take whole prompts (lowest hash first) until there are enough.
        ids = sorted({samples.prompt_ids[i] for i in usable}, key=bucket)
        chosen = set()
        for pid in ids:
            chosen.add(pid)
            if sum(samples.prompt_ids[i] in chosen for i in usable) >= min_eval:
                break
        evals = [i for i in usable if samples.prompt_ids[i] in chosen]
    eval_set = set(evals)
    return [i for i in usable if i not in eval_set], evals


def make_batches(samples: Samples, indices: list[int], batch_tokens: int, batch_anchors: int,
                 anchors_per_seq: int, rng: random.Random) -> list[list[int]]:
    """Batches of similar-length samples with padded tokens <= batch_tokens and anchors <= batch_anchors,
    in random order (a fresh shuffle of a length-sorted list with random tie-breaks)."""
    keyed = sorted(indices, key=lambda i: (len(samples.sequences[i]), rng.random()))
    batches, current, longest, anchors = [], [], 0, 0
    for i in keyed:
        n = len(samples.sequences[i])
        seq_anchors = min(anchors_per_seq, n - int(samples.prompt_len[i]) - 1)
        too_big = (len(current) + 1) * max(longest, n) > batch_tokens or anchors + seq_anchors > batch_anchors
        if current and too_big:
            batches.append(current)
            current, longest, anchors = [], 0, 0
        current.append(i)
        longest, anchors = max(longest, n), anchors + seq_anchors
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def device_batch(samples: Samples, indices: list[int], pad_id: int, device) -> dict:
    """ids [b, S] (right-padded with pad_id), lengths [b], loss_mask [b, S] (1 on response tokens)."""
    lengths = [len(samples.sequences[i]) for i in indices]
    s = max(lengths)
    ids = np.full((len(indices), s), pad_id, dtype=np.int64)
    mask = np.zeros((len(indices), s), dtype=bool)
    for row, i in enumerate(indices):
        seq = samples.sequences[i]
        ids[row, : len(seq)] = seq
        mask[row, int(samples.prompt_len[i]): len(seq)] = True
    return {
        "ids": torch.from_numpy(ids).to(device),
        "lengths": torch.tensor(lengths, device=device),
        "loss_mask": torch.from_numpy(mask).to(device),
        "prompt_len": torch.tensor([int(samples.prompt_len[i]) for i in indices], device=device),
    }
