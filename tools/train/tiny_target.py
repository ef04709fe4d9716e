#!/usr/bin/env python3
"""A tiny random target in the GGUF format of the real one, for CPU smoke runs of the whole training chain.

Same architecture (llama), tokenizer (vocabulary, merges, token types), chat template and special tokens as
SmolLM2-135M-Instruct's GGUF, which it copies; random f32 weights of a much smaller model (hidden 64, 6 layers,
4 / 2 heads, MLP 128). Every script reads it through the same path as the real target (target.read_gguf), so a
smoke run exercises the code that the GPU run executes, in seconds.

    python tools/train/tiny_target.py --out /tmp/tiny-target.gguf
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from target import DEFAULT_GGUF

DEFAULT_PATH = Path(tempfile.gettempdir()) / "dflash-train-tiny-target.gguf"
SHAPE = {"hidden": 64, "layers": 6, "heads": 4, "kv_heads": 2, "ffn": 128}
COPIED_FIELDS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")


def _contents(reader, key):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _tensors(rng: np.random.Generator, vocab: int) -> dict[str, np.ndarray]:
    """Random weights at a trained model's scale: unit norms, matrices ~ 1/sqrt(fan-in), an embedding whose
    logits (tied head) are peaked enough that greedy decoding is not a coin toss."""
    h, hd = SHAPE["hidden"], SHAPE["hidden"] // SHAPE["heads"]
    kv, ffn = SHAPE["kv_heads"] * hd, SHAPE["ffn"]

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    out = {"token_embd.weight": (rng.standard_normal((vocab, h)) * 0.4).astype(np.float32),
           "output_norm.weight": np.ones(h, dtype=np.float32)}
    for i in range(SHAPE["layers"]):
        out |= {f"blk.{i}.attn_q.weight": mat(h, h), f"blk.{i}.attn_k.weight": mat(kv, h),
                f"blk.{i}.attn_v.weight": mat(kv, h), f"blk.{i}.attn_output.weight": mat(h, h),
                f"blk.{i}.ffn_gate.weight": mat(ffn, h), f"blk.{i}.ffn_up.weight": mat(ffn, h),
                f"blk.{i}.ffn_down.weight": mat(h, ffn), f"blk.{i}.attn_norm.weight": np.ones(h, dtype=np.float32),
                f"blk.{i}.ffn_norm.weight": np.ones(h, dtype=np.float32)}
    return out


def write(out: Path, source: Path = DEFAULT_GGUF, seed: int = 0) -> Path:
    """Writes the tiny target to `out`, copying the tokenizer and chat template of `source`."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    tokens = _contents(reader, "tokenizer.ggml.tokens")
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_block_count(SHAPE["layers"])
    writer.add_context_length(int(_contents(reader, "llama.context_length")))
    writer.add_embedding_length(SHAPE["hidden"])
    writer.add_feed_forward_length(SHAPE["ffn"])
    writer.add_head_count(SHAPE["heads"])
    writer.add_head_count_kv(SHAPE["kv_heads"])
    writer.add_rope_freq_base(float(_contents(reader, "llama.rope.freq_base")))
    writer.add_layer_norm_rms_eps(float(_contents(reader, "llama.attention.layer_norm_rms_epsilon")))
    writer.add_tokenizer_model(_contents(reader, "tokenizer.ggml.model"))
    writer.add_tokenizer_pre(_contents(reader, "tokenizer.ggml.pre"))
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in _contents(reader, "tokenizer.ggml.token_type")])
    writer.add_token_merges(_contents(reader, "tokenizer.ggml.merges"))
    writer.add_bos_token_id(int(_contents(reader, "tokenizer.ggml.bos_token_id")))
    writer.add_eos_token_id(int(_contents(reader, "tokenizer.ggml.eos_token_id")))
    writer.add_chat_template(_contents(reader, "tokenizer.chat_template"))
    for name, value in _tensors(np.random.default_rng(seed), len(tokens)).items():
        writer.add_tensor(name, value)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def ensure(path: Path = DEFAULT_PATH, source: Path = DEFAULT_GGUF) -> Path:
    """The tiny target at `path`, written first if it is not there yet."""
    if not path.exists():
        tmp = path.with_suffix(".tmp.gguf")
        write(tmp, source)
        tmp.replace(path)  # concurrent smoke runs never see a half-written file
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--source", type=Path, default=DEFAULT_GGUF, help="the real target (tokenizer donor)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write(args.out, args.source, args.seed))


if __name__ == "__main__":
    main()
