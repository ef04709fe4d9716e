#!/usr/bin/env python3
"""Generates the golden-parity fixtures under crates/models/tests/fixtures/ (see tools/golden/README.md).

Usage (after `bash tools/golden/setup.sh`):
    .venv/bin/python tools/golden/make_fixtures.py [--only tiny-llama,tiny-qwen3,tiny-llama-gguf,smollm2]
                                                   [--smollm2-gguf PATH]

Outputs are deterministic (seeded weights, fixed inputs, f32 CPU reference). The smollm2 part needs the real
default model GGUF; without it that part is skipped and its existing golden file is left alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# Reproducible CPU maths: one BLAS/OpenMP thread and MKL's conditional-numerical-reproducibility mode, so the
# summation order does not depend on the machine's core count or load. Must be set before torch is imported.
for _name, _value in (("OMP_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1"), ("MKL_CBWR", "AUTO")):
    os.environ.setdefault(_name, _value)

import gguf  # noqa: F401  (imported early so a missing package fails before any folder is emptied)
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))

from golden_common import FIXTURES_DIR, describe_dir, set_determinism  # noqa: E402
from smollm2 import GGUF_FILE_NAME, build_smollm2  # noqa: E402
from tiny_gguf import build_tiny_gguf  # noqa: E402
from tiny_models import build_tiny_llama, build_tiny_qwen3  # noqa: E402

PARTS = ("tiny-llama", "tiny-qwen3", "tiny-llama-gguf", "smollm2")
# The whole fixtures folder (every generator's parts plus the tokenizer/ fixtures) must stay small enough to commit;
# it grows with each architecture and drafter covered.
SIZE_BUDGET_BYTES = 4 * 1024 * 1024


def default_smollm2_gguf() -> Path:
    """The model cache the dflash binary uses: $DFLASH_MODELS_DIR or ~/.cache/dflash/models."""
    models_dir = os.environ.get("DFLASH_MODELS_DIR") or str(Path.home() / ".cache" / "dflash" / "models")
    return Path(models_dir) / GGUF_FILE_NAME


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(PARTS), help="comma-separated subset of: " + ", ".join(PARTS))
    parser.add_argument("--smollm2-gguf", type=Path, default=None, help="path of the SmolLM2 Q4_1 GGUF")
    args = parser.parse_args()
    args.only = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = set(args.only) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts: {sorted(unknown)}")
    return args


def print_golden(name: str, tensors: dict, notes: dict) -> None:
    print(f"== {name}")
    for key in sorted(tensors):
        print(f"   {key}: {tensors[key].dtype} {list(tensors[key].shape)}")
    for key, value in notes.items():
        print(f"   note {key}: {json.dumps(value)}")


def main() -> int:
    args = parse_args()
    set_determinism()
    versions = {"transformers": transformers.__version__, "torch": torch.__version__}
    print(f"transformers {versions['transformers']}, torch {versions['torch']}")

    tiny_llama_state = None
    if "tiny-llama" in args.only or "tiny-llama-gguf" in args.only:
        # The GGUF fixture is built from the tiny-llama weights, so tiny-llama is (re)built first either way.
        tensors, notes, tiny_llama_state = build_tiny_llama(FIXTURES_DIR / "tiny-llama")
        print_golden("tiny-llama", tensors, notes)
    if "tiny-qwen3" in args.only:
        tensors, notes = build_tiny_qwen3(FIXTURES_DIR / "tiny-qwen3")
        print_golden("tiny-qwen3", tensors, notes)
    if "tiny-llama-gguf" in args.only:
        tensors, notes = build_tiny_gguf(FIXTURES_DIR / "tiny-llama-gguf", tiny_llama_state)
        print_golden("tiny-llama-gguf", tensors, notes)
    if "smollm2" in args.only:
        gguf_path = args.smollm2_gguf or default_smollm2_gguf()
        if gguf_path.is_file():
            notes = build_smollm2(FIXTURES_DIR / "smollm2", gguf_path, versions)
            print(f"== smollm2\n{json.dumps(notes, indent=1, ensure_ascii=False)}")
        else:
            print(f"== smollm2 skipped: {gguf_path} not found (existing golden.json left as is)")

    total = sum(p.stat().st_size for p in FIXTURES_DIR.rglob("*") if p.is_file())
    print("== files")
    for part in PARTS:
        if (FIXTURES_DIR / part).is_dir():
            print("\n".join(f"   {line}" for line in describe_dir(FIXTURES_DIR / part)))
    print(f"== total fixtures size {total} B (budget {SIZE_BUDGET_BYTES} B)")
    if total > SIZE_BUDGET_BYTES:
        print("error: fixtures exceed the size budget", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
