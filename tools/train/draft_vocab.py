#!/usr/bin/env python3
"""Ranks the target's tokens for the drafter's draft vocabulary and writes DRAFTER_DIR/draft_vocab.safetensors.

A drafter with a draft vocabulary scores only the N highest-ranked target tokens (a gathered slice of the
target's LM head), which makes drafting much cheaper for a small target whose 49,152-row head costs about as much
as its whole forward. The ranking is every token id of the target, ordered:

1. the target's control tokens (GGUF token type 3: `<|im_end|>`, `<|endoftext|>`, ...) before every other token,
   so every N includes the end of a reply;
2. within each of the two groups, by count in the training responses (what the target emits, greedy and T 0.7),
3. then by count in the training prompts (rare in responses, but present in text the target copies from),
4. then by id.

File layout (safetensors): `token_ids` int32 [vocab], most useful first; metadata `format`
(`dflash-draft-vocab`), `default_size` (the N the server uses unless `--draft-vocab` says otherwise; chosen by
measuring tok/s on the held-out prompts), `ranking` (the order above in words), `samples_sha256` (or, when the
counts come from a training checkpoint, which accumulates them over its runs: `counts_from`), `response_tokens`,
`coverage` (JSON: the share of response tokens the first N ids cover, for a few N).

    python tools/train/draft_vocab.py --samples OUT/data/samples.npz --out OUT/export/drafter
    python tools/train/draft_vocab.py --samples S.npz --out DIR --default-size 8192 --gguf target.gguf
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from target import DEFAULT_GGUF

FILE_NAME = "draft_vocab.safetensors"
# Measured with `dflash bench lanes` on bench/prompts/heldout.json (docs/BENCHMARKS.md): the best decode speed.
DEFAULT_SIZE = 8192
CONTROL_TOKEN_TYPE = 3
COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


def target_vocab(gguf_path: Path) -> tuple[int, list[int]]:
    """(vocabulary size, control token ids) from the GGUF's tokenizer metadata (no tensor is read)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    return len(types), [i for i, t in enumerate(types) if int(t) == CONTROL_TOKEN_TYPE]


def token_counts(samples: Path, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(response counts, prompt counts) per token id over every sample of generate.py's .npz."""
    data = np.load(samples)
    tokens, offsets, prompt_len = data["tokens"].astype(np.int64), data["offsets"], data["prompt_len"]
    is_response = np.zeros(len(tokens), dtype=bool)
    for i in range(len(offsets) - 1):
        is_response[offsets[i] + int(prompt_len[i]): offsets[i + 1]] = True
    if tokens.size and tokens.max() >= vocab:
        raise SystemExit(f"{samples}: token id {tokens.max()} outside the {vocab}-token vocabulary")
    return (np.bincount(tokens[is_response], minlength=vocab), np.bincount(tokens[~is_response], minlength=vocab))


def rank(response: np.ndarray, prompt: np.ndarray, control: list[int]) -> np.ndarray:
    """Every id: control tokens first; within each group by response count, prompt count (both descending), id."""
    ids = np.arange(len(response))
    is_control = np.zeros(len(response), dtype=bool)
    is_control[control] = True
    # lexsort sorts by the last key first.
    order = np.lexsort((ids, -prompt, -response, ~is_control))
    return order.astype(np.int32)


def coverage(ranking: np.ndarray, response: np.ndarray, sizes=COVERAGE_SIZES) -> dict[str, float]:
    total = max(int(response.sum()), 1)
    return {str(n): round(float(response[ranking[:n]].sum()) / total, 6) for n in sizes if n <= len(ranking)}


def write(out_dir: Path, ranking: np.ndarray, default_size: int, meta: dict[str, str]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / FILE_NAME
    metadata = {"format": "dflash-draft-vocab", "default_size": str(default_size), **meta}
    save_file({"token_ids": np.ascontiguousarray(ranking, dtype=np.int32)}, str(path), metadata=metadata)
    return path


def build(samples: Path, gguf_path: Path, out_dir: Path, default_size: int = DEFAULT_SIZE) -> dict:
    """Ranks the tokens of generate.py's samples, writes the file and returns its summary."""
    vocab, _ = target_vocab(gguf_path)
    response, prompt = token_counts(samples, vocab)
    source = {"samples_sha256": hashlib.sha256(samples.read_bytes()).hexdigest()}
    return build_from_counts(response, prompt, gguf_path, out_dir, default_size, source)


def build_from_counts(response: np.ndarray, prompt: np.ndarray, gguf_path: Path, out_dir: Path,
                      default_size: int = DEFAULT_SIZE, source: dict | None = None) -> dict:
    """Ranks by token counts (a training checkpoint accumulates them over all its runs' data), writes the file
    and returns its summary."""
    vocab, control = target_vocab(gguf_path)
    if len(response) != vocab:
        raise SystemExit(f"token counts cover {len(response)} ids, the target has {vocab}")
    ranking = rank(response, prompt, control)
    cov = coverage(ranking, response)
    meta = {
        "ranking": "control tokens first; then response-token count, prompt-token count (descending), token id",
        **(source or {}),
        "response_tokens": str(int(response.sum())),
        "coverage": json.dumps(cov),
    }
    path = write(out_dir, ranking, default_size, meta)
    return {"file": str(path), "default_size": default_size, "vocab": vocab, "control_tokens": len(control),
            "response_tokens": int(response.sum()), "distinct_response_tokens": int((response > 0).sum()),
            "coverage": cov}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=Path, required=True, help="samples .npz from generate.py")
    parser.add_argument("--out", type=Path, required=True, help="the drafter directory to write into")
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--default-size", type=int, default=DEFAULT_SIZE)
    args = parser.parse_args()
    if args.default_size <= 0:
        parser.error("--default-size must be positive")
    print(json.dumps(build(args.samples, args.gguf, args.out, args.default_size), indent=1))


if __name__ == "__main__":
    main()
