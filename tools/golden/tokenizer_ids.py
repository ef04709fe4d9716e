#!/usr/bin/env python3
"""Golden token ids and chat-template renderings for the SmolLM2 GGUF tokenizer.

Writes crates/models/tests/fixtures/tokenizer/smollm2_ids.json, which crates/models/tests/tokenizer_smollm2.rs
compares the Rust tokenizer (built from the same GGUF file) against.

Usage:
    python -m venv .venv-tok
    .venv-tok/bin/pip install "transformers==4.57.6" "tokenizers==0.22.*" gguf sentencepiece protobuf
    .venv-tok/bin/python tools/golden/tokenizer_ids.py [--model PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf]

The model defaults to ~/.cache/dflash/models/SmolLM2-135M-Instruct.Q4_1.gguf. No torch is needed.

Reference tokenizer. transformers' own GGUF conversion (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) does
NOT reproduce the real SmolLM2 tokenizer, so it is not the reference. As of transformers 4.57 it builds
    pre_tokenizer  ByteLevel(add_prefix_space=False, trim_offsets=False)      -- no Digits(individual_digits) split
    post_processor TemplateProcessing prepending <|im_start|> as BOS          -- SmolLM2 adds no BOS
    decoder        ByteFallback + Fuse + Replace + ByteLevel, BPE with unk/byte_fallback
and reports eos_token = <|im_start|>. The script prints that configuration and the texts on which its ids differ.
The reference is instead built here with the `tokenizers` package from the GGUF vocabulary/merges and the
description of SmolLM2's published tokenizer.json:
    pre_tokenizer  Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, trim_offsets=True,
                   use_regex=True)]
    post_processor ByteLevel(trim_offsets=False) (adds nothing), decoder ByteLevel
    model          BPE(vocab, merges), no unk token, no dropout, no byte fallback
    added tokens   GGUF token_type 3 (control) as special tokens, 4 (user-defined) as non-special ones
Chat renderings come from transformers' `apply_chat_template` on that reference tokenizer with the GGUF's
chat template (add_generation_prompt=True).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import gguf
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

REPO_ROOT = Path(__file__).resolve().parents[2]
OUT_PATH = REPO_ROOT / "crates" / "models" / "tests" / "fixtures" / "tokenizer" / "smollm2_ids.json"
DEFAULT_MODEL = Path.home() / ".cache" / "dflash" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

TEXTS: list[str] = [
    # English
    "Hello",
    " Hello",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's what we'd've wanted; DON'T you think?",
    # Multilingual
    "你好，世界！今天天气很好。",
    "مرحبا بالعالم، كيف حالك؟",
    "Привет, как дела? Всё хорошо.",
    "Emoji: 😀🎉👍🏽 and a flag 🇫🇷 and a family 👨‍👩‍👧",
    "Café naïve résumé Ångström façade Zürich",
    "日本語のテキストとカタカナ、한국어 텍스트",
    "Ελληνικά και हिन्दी और ไทย",
    "Unicode\u00a0no-break\u200bzero-width\ufeffbom",
    # Code
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'fn main() {\n\tlet v: Vec<u32> = (0..10).collect();\n\tprintln!("{:?}", v);\n}\n',
    "if (x != y && a >= b) { return -1; } // comment\n/* block */",
    '<div class="x">&amp; &lt;tag&gt;</div>',
    # Digits
    "1234567890123456789",
    "pi = 3.14159, e = 2.71828",
    "Date: 2024-03-15 12:34:56, 15/03/2024",
    "Price: $1,299.99 (-15%) x10^6",
    # Non-ASCII numerals: Digits(individual_digits) splits every Unicode number, and this vocabulary has merges
    # with superscripts, so these ids show whether the Digits pre-tokenizer is present.
    "E = mc², x³ + y¹, H₂O, ½ and Ⅻ; Ù³ ¹²³",
    # Whitespace
    "multiple   spaces    here",
    "line1\nline2\n\n\nline5",
    "trailing spaces   ",
    "\t\tindented with tabs\n  and spaces\r\n",
    "   ",
    "\n",
    "",
    # Chat-special tokens
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text <|endoftext|> more <repo_name> x<file_sep>y",
    "<|im_start| not quite special <|im_end",
]

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Count to 3, please. 数字 too."},
    ],
]


def read_gguf_tokenizer(path: Path) -> dict:
    """The tokenizer.* metadata of a GGUF file."""
    reader = gguf.GGUFReader(path)

    def field(key: str):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    return {
        "model": field("tokenizer.ggml.model"),
        "pre": field("tokenizer.ggml.pre"),
        "tokens": field("tokenizer.ggml.tokens"),
        "token_types": field("tokenizer.ggml.token_type"),
        "merges": field("tokenizer.ggml.merges"),
        "bos_id": field("tokenizer.ggml.bos_token_id"),
        "eos_id": field("tokenizer.ggml.eos_token_id"),
        "add_bos": field("tokenizer.ggml.add_bos_token"),
        "chat_template": field("tokenizer.chat_template"),
    }


def build_reference(meta: dict) -> Tokenizer:
    """SmolLM2's tokenizer.json pipeline over the GGUF vocabulary (see the module docstring)."""
    assert meta["model"] == "gpt2" and meta["pre"] == "smollm", (meta["model"], meta["pre"])
    vocab = {tok: i for i, tok in enumerate(meta["tokens"])}
    assert len(vocab) == len(meta["tokens"]), "duplicate token strings"
    merges = [tuple(m.split(" ")) for m in meta["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    added = [
        AddedToken(t, special=(ty == TOKEN_TYPE_CONTROL), normalized=False)
        for t, ty in zip(meta["tokens"], meta["token_types"])
        if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    tok.add_tokens(added)
    for t in added:
        assert tok.token_to_id(t.content) == vocab[t.content], t.content
    return tok


def transformers_gguf_tokenizer(model: Path):
    """transformers' own GGUF conversion, for comparison only. Its loader refuses to run without torch although
    reading tokenizer metadata never touches a tensor, so the availability check is bypassed."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoTokenizer

    gguf_utils.is_torch_available = lambda: True
    return AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)


def report_transformers_conversion(model: Path, reference: Tokenizer) -> dict:
    """Prints how transformers' GGUF conversion differs from the reference; returns a summary for the fixture."""
    try:
        hf = transformers_gguf_tokenizer(model)
    except Exception as e:  # noqa: BLE001 - diagnostic only
        print(f"transformers GGUF conversion unavailable: {e}", file=sys.stderr)
        return {"available": False}
    config = json.loads(hf.backend_tokenizer.to_str())
    for key in ("pre_tokenizer", "post_processor", "decoder"):
        print(f"transformers GGUF {key}: {json.dumps(config[key])}")
    print(f"transformers GGUF bos={hf.bos_token!r} eos={hf.eos_token!r}")
    differing = []
    for text in TEXTS:
        ref_ids = reference.encode(text, add_special_tokens=False).ids
        hf_ids = hf.encode(text, add_special_tokens=False)
        if ref_ids != hf_ids:
            differing.append(text)
            print(f"  ids differ for {text!r}:\n    reference    {ref_ids}\n    transformers {hf_ids}")
    print(f"transformers GGUF conversion differs on {len(differing)}/{len(TEXTS)} texts (without BOS)")
    return {
        "available": True,
        "pre_tokenizer": config["pre_tokenizer"],
        "bos_token": hf.bos_token,
        "eos_token": hf.eos_token,
        "adds_bos": hf.encode("x") != hf.encode("x", add_special_tokens=False),
        "texts_with_different_ids": differing,
    }


def chat_renderings(reference: Tokenizer, meta: dict) -> list[dict]:
    from transformers import PreTrainedTokenizerFast

    tokens = meta["tokens"]
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=reference,
        bos_token=tokens[meta["bos_id"]],
        eos_token=tokens[meta["eos_id"]],
        chat_template=meta["chat_template"],
    )
    out = []
    for messages in CONVERSATIONS:
        rendered = wrapped.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = reference.encode(rendered, add_special_tokens=False).ids
        out.append({"messages": messages, "add_generation_prompt": True, "rendered": rendered, "ids": ids})
    return out


def to_json(value) -> str:
    """Indented JSON with each id list on one line (JSON strings cannot hold a raw newline, so only arrays match)."""
    text = json.dumps(value, ensure_ascii=False, indent=1)

    def one_line(m: re.Match) -> str:
        return "[" + ", ".join(re.findall(r"\d+", m.group(0))) + "]"

    return re.sub(r"\[\n(?:\s*\d+,?\n)+\s*\]", one_line, text) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--out", type=Path, default=OUT_PATH)
    args = parser.parse_args()

    meta = read_gguf_tokenizer(args.model)
    reference = build_reference(meta)
    cases = []
    for text in TEXTS:
        ids = reference.encode(text, add_special_tokens=False).ids
        decoded = reference.decode(ids, skip_special_tokens=False)
        assert decoded == text, (text, decoded)
        cases.append(
            {"text": text, "ids": ids, "decoded_skip_special": reference.decode(ids, skip_special_tokens=True)}
        )
    fixture = {
        "generator": "tools/golden/tokenizer_ids.py",
        "model_file": args.model.name,
        "reference": "tokenizers pipeline of SmolLM2's tokenizer.json over the GGUF vocabulary (see the generator)",
        "vocab_size": len(meta["tokens"]),
        "bos_id": meta["bos_id"],
        "eos_id": meta["eos_id"],
        "add_bos": bool(meta["add_bos"]),
        "texts": cases,
        "chat": chat_renderings(reference, meta),
        "transformers_gguf_conversion": report_transformers_conversion(args.model, reference),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(to_json(fixture), encoding="utf-8")
    print(f"wrote {len(cases)} texts and {len(fixture['chat'])} chats to {args.out.relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()
