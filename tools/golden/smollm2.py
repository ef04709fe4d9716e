"""smollm2/golden.json: reference behaviour of the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF).

transformers loads the GGUF by dequantizing every tensor to f32 (and un-permuting q/k back to HF's half-split
rope layout); the tokenizer and its ChatML template come from the same file. For each prompt we record:
  * prompt_ids: the chat-templated prompt (add_generation_prompt=True), and the rendered text;
  * greedy_tokens: 32 greedy tokens (cached decoding, EOS does not stop it; eos_index says where the first
    EOS is, if any) and greedy_top2_gap: the top-1 minus top-2 logit at each step;
  * teacher_forced over prompt_ids + greedy_tokens (one forward): argmax, top5_ids and top5_logits at every
    position (position i predicts token i + 1).
Logits are rounded to 4 decimals to keep the file small.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from golden_common import greedy_continuation, reset_dir, top2_gap

GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GREEDY_TOKENS = 32
TOP_K = 5

SUMMARY_TEXT = (
    "The printing press, developed by Johannes Gutenberg around 1440, transformed how knowledge spread across "
    "Europe. Before its invention, books were copied by hand, usually by monks, which made them rare and "
    "expensive. Gutenberg combined movable metal type, oil-based ink and a modified wine press into a system "
    "that could produce pages quickly and consistently. Within a few decades, printing shops had appeared in "
    "more than two hundred cities. The cost of books fell sharply, literacy began to rise, and ideas could "
    "travel faster than ever before. Scholars could compare identical copies of a text, which helped science "
    "become more cumulative. The press also played a central role in the Reformation, as pamphlets and "
    "translated Bibles reached ordinary readers. Historians often describe it as one of the most important "
    "inventions of the second millennium, because it laid the groundwork for mass communication."
)

PROMPTS: list[tuple[str, str]] = [
    ("capital", "What is the capital of France?"),
    ("code", "Write a short Python function that returns the n-th Fibonacci number iteratively."),
    ("summary", f"Summarize the following text in two sentences.\n\n{SUMMARY_TEXT}"),
]


def teacher_forced(model, ids: list[int]) -> dict[str, list]:
    """One forward over `ids`; argmax and top-k (ids, logits) at every position."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False).logits[0].float()
    top = torch.topk(logits, TOP_K, dim=-1)
    return {
        "argmax": torch.argmax(logits, dim=-1).tolist(),
        "top5_ids": top.indices.tolist(),
        "top5_logits": [[round(float(v), 4) for v in row] for row in top.values],
    }


def gguf_special_ids(gguf_path: Path) -> dict[str, int]:
    """BOS/EOS ids as the GGUF metadata states them.

    Read from the file rather than from the converted tokenizer: transformers 4.57's GGUF tokenizer conversion
    reports eos_token_id 1 (<|im_start|>) for this file, whose metadata says 2 (<|im_end|>).
    """
    reader = gguf.GGUFReader(str(gguf_path))
    return {
        "bos_token_id": int(reader.fields["tokenizer.ggml.bos_token_id"].contents()),
        "eos_token_id": int(reader.fields["tokenizer.ggml.eos_token_id"].contents()),
    }


def golden_for_prompt(model, tokenizer, eos: int, name: str, user_text: str) -> tuple[dict, dict]:
    """Greedy continuation and teacher-forced statistics for one chat prompt; returns (entry, notes)."""
    messages = [{"role": "user", "content": user_text}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert prompt_ids == tokenizer.encode(rendered, add_special_tokens=False), "template ids != encode(text)"

    greedy, step_logits = greedy_continuation(model, prompt_ids, GREEDY_TOKENS)
    eos_index = greedy.index(eos) if eos in greedy else None
    forced = teacher_forced(model, prompt_ids + greedy)
    # Position p predicts token p + 1: the greedy tokens are the forced argmaxes from the last prompt row on.
    forced_greedy = forced["argmax"][len(prompt_ids) - 1 : len(prompt_ids) - 1 + GREEDY_TOKENS]
    mismatches = [i for i, (a, b) in enumerate(zip(forced_greedy, greedy)) if a != b]

    gaps = [round(top2_gap(l), 4) for l in step_logits]
    entry = {
        "name": name,
        "user": user_text,
        "rendered": rendered,
        "prompt_ids": prompt_ids,
        "greedy_tokens": greedy,
        "greedy_text": tokenizer.decode(greedy),
        "eos_index": eos_index,
        "greedy_top2_gap": gaps,
        "teacher_forced": forced,
    }
    notes = {
        "prompt_tokens": len(prompt_ids),
        "eos_index": eos_index,
        "min_top2_gap": min(gaps),
        "cached_vs_forced_argmax_mismatches": mismatches,
        "greedy_text": entry["greedy_text"],
    }
    return entry, notes


def write_compact_json(path: Path, doc: dict) -> None:
    """Top-level keys and each prompt's fields on their own lines, every value compact: small and diffable."""
    compact = lambda value: json.dumps(value, separators=(",", ":"), ensure_ascii=False)  # noqa: E731
    lines = ["{"]
    items = list(doc.items())
    for index, (key, value) in enumerate(items):
        comma = "," if index + 1 < len(items) else ""
        if key != "prompts":
            lines.append(f" {compact(key)}:{compact(value)}{comma}")
            continue
        lines.append(' "prompts":[')
        for p_index, prompt in enumerate(value):
            fields = [f"  {compact(k)}:{compact(v)}" for k, v in prompt.items()]
            lines.append("  {\n" + ",\n".join(fields) + "\n  }" + ("," if p_index + 1 < len(value) else ""))
        lines.append(f" ]{comma}")
    lines.append("}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    json.loads(path.read_text(encoding="utf-8"))  # the hand-laid layout must still be valid JSON


def build_smollm2(out_dir: Path, gguf_path: Path, versions: dict[str, str]) -> dict[str, object]:
    """Writes smollm2/golden.json from the GGUF at gguf_path."""
    reset_dir(out_dir)
    model_dir, file_name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=file_name)
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=file_name, dtype=torch.float32)
    model.eval()

    special = gguf_special_ids(gguf_path)
    prompts, notes = [], {}
    for name, user_text in PROMPTS:
        entry, prompt_notes = golden_for_prompt(model, tokenizer, special["eos_token_id"], name, user_text)
        prompts.append(entry)
        notes[name] = prompt_notes
    doc = {
        "model_file": file_name,
        "reference": "transformers GGUF load (weights dequantized to f32), f32 CPU forward, batch 1",
        "versions": versions,
        **special,
        "greedy_tokens_per_prompt": GREEDY_TOKENS,
        "top_k": TOP_K,
        "prompts": prompts,
    }
    write_compact_json(out_dir / "golden.json", doc)
    return notes
