"""Training data: the generated samples, their train / evaluation split, and length-bucketed batches.

A sample is prompt + response token ids. Its response may start with a few tokens sampled at some temperature
(a sampled prefix, which varies the context) and continue greedily: `greedy_start` is the first position whose
token the target chose greedily, and every later response token is greedy (pure greedy samples start at the
prompt's end; an old-format sampled response never becomes greedy). `split` comes from generate.py: 0 train,
1 held-out training-distribution prompts (the same few hundred prompts in every run, so runs compare), 2 the
hand-written out-of-distribution prompts of bench/prompts/heldout.json.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SPLIT_TRAIN, SPLIT_HELDOUT, SPLIT_BENCH = 0, 1, 2
SPLIT_NAMES = {SPLIT_HELDOUT: "heldout", SPLIT_BENCH: "bench"}


@dataclass
class Samples:
    sequences: list[np.ndarray]  # prompt + response token ids
    prompt_len: np.ndarray
    greedy_start: np.ndarray  # first position of the greedy part of the response
    split: np.ndarray
    info: dict

    def __len__(self) -> int:
        return len(self.sequences)

    def is_pure_greedy(self, i: int) -> bool:
        return int(self.greedy_start[i]) == int(self.prompt_len[i])


def load_samples(path: Path) -> Samples:
    data = np.load(path)
    offsets = data["offsets"]
    tokens = data["tokens"].astype(np.int64)
    sequences = [tokens[offsets[i]: offsets[i + 1]] for i in range(len(offsets) - 1)]
    prompt_len = data["prompt_len"].astype(np.int64)
    if "greedy_from" in data:
        greedy_start = prompt_len + data["greedy_from"].astype(np.int64)
        split = data["split"].astype(np.int64)
    else:  # first-generation files: greedy or fully sampled, split by a hash of the prompt id
        greedy_start = np.where(data["temperature"] == 0, prompt_len, offsets[1:] - offsets[:-1])
        split = np.zeros(len(sequences), dtype=np.int64)
    info = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    return Samples(sequences, prompt_len, greedy_start, split, info)


def repeat_end(response: np.ndarray, window: int) -> int | None:
    """The end of the first repeat of a `window`-token run inside `response` (the index just past the run's
    second occurrence), or None when no run repeats."""
    if window <= 0 or len(response) < 2 * window:
        return None
    runs = np.lib.stride_tricks.sliding_window_view(response.astype(np.int64), window)
    # A random linear hash of each run (wrapping int64 arithmetic); equal hashes are confirmed exactly.
    coeffs = np.random.default_rng(window).integers(1, 1 << 62, size=window, dtype=np.int64)
    with np.errstate(over="ignore"):
        hashes = runs @ coeffs
    _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
    for j in np.nonzero(first[inverse] < np.arange(len(hashes)))[0]:
        earlier = np.nonzero(hashes[:j] == hashes[j])[0]  # almost always one run: the first of this hash
        if any(np.array_equal(runs[i], runs[j]) for i in earlier):
            return int(j) + window
    return None


def trim_repeats(samples: Samples, indices: list[int], window: int) -> tuple[int, int]:
    """Cuts the given samples' responses after the first repeat of a `window`-token run: a long greedy response
    of a small target often ends in a loop, which every drafter predicts and prompt lookup drafts for free, so
    the loop's tokens would spend training on what is already solved. Returns (samples cut, tokens removed)."""
    cut = removed = 0
    for i in indices:
        begin = int(samples.prompt_len[i])
        end = repeat_end(samples.sequences[i][begin:], window)
        if end is not None and begin + end < len(samples.sequences[i]):
            removed += len(samples.sequences[i]) - begin - end
            samples.sequences[i] = samples.sequences[i][: begin + end]
            cut += 1
    return cut, removed


def data_id(samples: Samples) -> str:
    """A short fingerprint of the samples (the data cursor of a checkpoint belongs to one data set)."""
    h = hashlib.sha256()
    h.update(np.asarray([len(s) for s in samples.sequences], dtype=np.int64).tobytes())
    for seq in samples.sequences[:: max(1, len(samples) // 256)]:
        h.update(np.asarray(seq, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def split_indices(samples: Samples) -> dict[str, list[int]]:
    """{'train': [...], 'heldout': [...], 'bench': [...]}: samples with at least one trainable response token."""
    usable = [i for i in range(len(samples)) if len(samples.sequences[i]) > samples.prompt_len[i] + 1]
    out = {"train": [i for i in usable if samples.split[i] == SPLIT_TRAIN]}
    for value, name in SPLIT_NAMES.items():
        out[name] = [i for i in usable if samples.split[i] == value]
    return out


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


class BatchCursor:
    """Epochs of batches over one data set, resumable: epoch e's order depends only on (seed, data id, e), so
    (epoch, next batch) is the whole cursor."""

    def __init__(self, samples: Samples, indices: list[int], seed: int, sizes: dict, cursor: dict | None = None):
        self.samples, self.indices, self.seed, self.sizes = samples, indices, seed, sizes
        self.data_id = data_id(samples)
        same_data = cursor is not None and cursor.get("data_id") == self.data_id
        self.epoch = int(cursor["epoch"]) if same_data else 0
        self.position = int(cursor["batch"]) if same_data else 0
        self._batches: list[list[int]] | None = None

    def _epoch_batches(self) -> list[list[int]]:
        if self._batches is None:
            rng = random.Random(f"{self.seed}:{self.data_id}:{self.epoch}")
            self._batches = make_batches(self.samples, self.indices, self.sizes["batch_tokens"],
                                         self.sizes["batch_anchors"], self.sizes["anchors_per_seq"], rng)
            if not self._batches:
                raise ValueError("no training batches: the data has no trainable sample")
        return self._batches

    def next(self) -> list[int]:
        while self.position >= len(self._epoch_batches()):
            self.epoch, self.position, self._batches = self.epoch + 1, 0, None
        batch = self._epoch_batches()[self.position]
        self.position += 1
        return batch

    def state(self) -> dict:
        return {"data_id": self.data_id, "epoch": self.epoch, "batch": self.position}

    def epochs_done(self) -> float:
        return self.epoch + self.position / max(1, len(self._epoch_batches()))


def device_batch(samples: Samples, indices: list[int], pad_id: int, device) -> dict:
    """ids [b, S] (right-padded with pad_id), lengths [b], loss_mask [b, S] (response tokens), greedy [b, S]
    (response tokens the target chose greedily), prompt_len [b]."""
    lengths = [len(samples.sequences[i]) for i in indices]
    s = max(lengths)
    ids = np.full((len(indices), s), pad_id, dtype=np.int64)
    mask = np.zeros((len(indices), s), dtype=bool)
    greedy = np.zeros((len(indices), s), dtype=bool)
    for row, i in enumerate(indices):
        seq = samples.sequences[i]
        ids[row, : len(seq)] = seq
        mask[row, int(samples.prompt_len[i]): len(seq)] = True
        greedy[row, int(samples.greedy_start[i]): len(seq)] = True
    return {
        "ids": torch.from_numpy(ids).to(device),
        "lengths": torch.tensor(lengths, device=device),
        "loss_mask": torch.from_numpy(mask).to(device),
        "greedy": torch.from_numpy(greedy).to(device),
        "prompt_len": torch.tensor([int(samples.prompt_len[i]) for i in indices], device=device),
    }


def token_counts(samples: Samples, indices: list[int], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(response counts, prompt counts) per token id over the given samples (for the draft vocabulary)."""
    empty = np.zeros(0, dtype=np.int64)
    responses = [samples.sequences[i][int(samples.prompt_len[i]):] for i in indices]
    prompts = [samples.sequences[i][: int(samples.prompt_len[i])] for i in indices]
    response = np.bincount(np.concatenate(responses or [empty]), minlength=vocab)[:vocab]
    prompt = np.bincount(np.concatenate(prompts or [empty]), minlength=vocab)[:vocab]
    return response.astype(np.int64), prompt.astype(np.int64)
