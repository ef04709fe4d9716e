#!/usr/bin/env python3
"""Exports the trained drafter and MTP head in their published formats, then checks them.

    OUT/drafter/config.json         DFlash2DraftModel config (Qwen3 fields; DFlash fields in dflash_config)
    OUT/drafter/model.safetensors   bf16; tensor names as the reference expects, the selector codebooks without a
                                    `.weight` suffix (dflash-spec.md §1.3)
    OUT/drafter/draft_vocab.safetensors
                                    the token ranking of the draft vocabulary (draft_vocab.py), from the token
                                    counts the checkpoint accumulated over its runs (or from --samples)
    OUT/mtp/config.json             the target's geometry plus mtp_num_hidden_layers and the head's conventions
    OUT/mtp/model.safetensors       bf16; `mtp.*` tensors (Qwen3-Next layout, see mtp.py)
    OUT/metrics.json                training metrics, sizes, and the reference check's results

Together the two safetensors files must stay under 40 MB (checked). The checkpoint may be either form that train.py
writes (train_state.pt or the compact resume.pt): the exported bf16 weights are the same. The check
(reference_check.py) loads the drafter with the reference `dflash` package, compares its tensors and its forward
with the training forward, drafts greedily with the reference decode loop on bench/prompts/heldout-small.json (the
output must equal plain greedy decoding), and measures both drafters' greedy acceptance.

    python tools/train/export.py --ckpt OUT/ckpt/resume.pt --out OUT/export
    python tools/train/export.py --check-only OUT/export          # re-check an export (e.g. after fetching it)
    python tools/train/export.py --smoke --ckpt /tmp/smoke/ckpt/resume.pt --out /tmp/smoke/export
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import checkpoint as ckpt
import draft_vocab
import tiny_target
from target import DEFAULT_GGUF

SIZE_LIMIT_BYTES = 40_000_000  # both heads together (the drafters' size budget)
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def log(msg: str) -> None:
    print(f"[export {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def drafter_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """bf16 tensors under their published names (codebooks lose `.weight`)."""
    out = {}
    for name, value in state.items():
        if name.removesuffix(".weight") in CODEBOOKS:
            name = name.removesuffix(".weight")
        out[name] = value.detach().to(torch.bfloat16).contiguous()
    return out


def mtp_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"mtp.{k}": v.detach().to(torch.bfloat16).contiguous() for k, v in state.items()}


def read_drafter(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(drafter config, f32 state dict under the training model's names) of an exported drafter folder: the
    inverse of the export, so a new series can start from shipped weights."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config.pop("dtype", None)
    state = {f"{name}.weight" if name in CODEBOOKS else name: value.float()
             for name, value in load_file(str(folder / "model.safetensors")).items()}
    return config, state


def read_mtp(folder: Path) -> dict[str, torch.Tensor]:
    """The f32 state dict of an exported MTP head folder (`mtp.` prefix removed)."""
    return {name.removeprefix("mtp."): value.float()
            for name, value in load_file(str(folder / "model.safetensors")).items()}


def mtp_config(target_cfg: dict, depth_weights: list[float], gguf_name: str) -> dict:
    return {
        "architectures": ["MtpHead"],
        "model_type": "llama",
        "hidden_size": target_cfg["hidden_size"],
        "intermediate_size": target_cfg["intermediate_size"],
        "num_hidden_layers": target_cfg["num_layers"],
        "num_attention_heads": target_cfg["num_heads"],
        "num_key_value_heads": target_cfg["num_kv_heads"],
        "head_dim": target_cfg["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": target_cfg["rms_norm_eps"],
        "rope_theta": target_cfg["rope_theta"],
        "rope_scaling": None,
        "vocab_size": target_cfg["vocab_size"],
        "max_position_embeddings": target_cfg["context_length"],
        "tie_word_embeddings": True,
        "bos_token_id": target_cfg["bos_id"],
        "eos_token_id": target_cfg["eos_id"],
        "dtype": "bfloat16",
        "mtp_num_hidden_layers": 1,
        "mtp_config": {
            "target": gguf_name,
            "tensor_prefix": "mtp.",
            "hidden_input": "target final-norm output (the hidden state that feeds the LM head)",
            "fc_input_order": ["pre_fc_norm_embedding(embedding of token j+1)", "pre_fc_norm_hidden(hidden at j)"],
            "rope_position": "j, the position of the hidden state",
            "predicts": "token j+2",
            "chained_hidden_input": "the previous step's output after mtp.norm",
            "norm": "rms_norm: x / rms(x) * weight (weights near 1, not zero-centred)",
            "decoder_layer": "llama: q/k/v/o projections without bias, no q/k norm, silu gated MLP",
            "shared_with_target": ["embed_tokens", "lm_head (tied to embed_tokens)"],
            "trained_depths": len(depth_weights),
            "depth_loss_weights": depth_weights,
        },
    }


def write_export(state: dict, out: Path, smoke: bool) -> dict:
    """Writes both folders; returns {file: bytes}."""
    draft_dir, mtp_dir = out / "drafter", out / "mtp"
    draft_dir.mkdir(parents=True, exist_ok=True)
    config = dict(state["drafter_config"], dtype="bfloat16")
    (draft_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(drafter_tensors(state["drafter_state"]), str(draft_dir / "model.safetensors"), metadata={"format": "pt"})
    files = [draft_dir / "model.safetensors"]
    if state["mtp_state"] is not None:
        mtp_dir.mkdir(parents=True, exist_ok=True)
        cfg = mtp_config(state["target_config"], state["mtp_depth_weights"], state["target"]["gguf"])
        (mtp_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        save_file(mtp_tensors(state["mtp_state"]), str(mtp_dir / "model.safetensors"), metadata={"format": "pt"})
        files.append(mtp_dir / "model.safetensors")
    sizes = {str(f.relative_to(out)): f.stat().st_size for f in files}
    total = sum(sizes.values())
    log(f"wrote {', '.join(f'{k} {v / 1e6:.2f} MB' for k, v in sizes.items())}; total {total / 1e6:.2f} MB")
    if total > SIZE_LIMIT_BYTES and not smoke:
        raise SystemExit(f"exported weights are {total} bytes, over the {SIZE_LIMIT_BYTES}-byte limit")
    return sizes


def run_overview(runs: list[dict]) -> list[dict]:
    """Per run of the checkpoint's series: steps, data and held-out acceptance (metrics.jsonl has the rest)."""
    out = []
    for r in runs:
        walk = r.get("eval", {}).get("bench", {}).get("dflash_greedy_walk", {})
        out.append({"run": r["run"], "steps": r["steps"], "trained": r["trained"],
                    "response_tokens": (r.get("data") or {}).get("response_tokens"),
                    "bench_tokens_per_round": walk.get("tokens_per_round")})
    return out


def write_draft_vocab(state: dict, args, drafter_dir: Path) -> dict | None:
    if args.samples is not None:
        summary = draft_vocab.build(args.samples, args.gguf, drafter_dir)
    elif state.get("token_counts") is not None:
        counts = state["token_counts"]
        summary = draft_vocab.build_from_counts(counts["response"].numpy(), counts["prompt"].numpy(), args.gguf,
                                                drafter_dir, source={"counts_from": f"training step {state['step']}"})
    else:
        return None
    log(f"draft vocabulary ranking written (default size {summary['default_size']})")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, help="train_state.pt from train.py")
    parser.add_argument("--out", type=Path, help="export directory")
    parser.add_argument("--check-only", type=Path, help="check an existing export directory, write nothing else")
    parser.add_argument("--no-check", action="store_true", help="only write the files")
    parser.add_argument("--gguf", type=Path, default=None, help=f"the target (default {DEFAULT_GGUF})")
    parser.add_argument("--samples", type=Path,
                        help="rank the draft vocabulary from these samples instead of the checkpoint's counts")
    parser.add_argument("--prompts", type=Path, help="held-out prompts for the check (default heldout-small.json)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="CPU, two short prompts, 12 tokens")
    args = parser.parse_args()
    if args.gguf is None:
        args.gguf = tiny_target.ensure() if args.smoke else DEFAULT_GGUF
    import reference_check

    if args.check_only:
        out, report = args.check_only, {}
    else:
        if args.ckpt is None or args.out is None:
            parser.error("--ckpt and --out are required unless --check-only is given")
        state = ckpt.load(args.ckpt)
        out = args.out
        report = {"sizes": write_export(state, out, args.smoke), "train_metrics": state["metrics"],
                  "step": state["step"], "schedule": state["schedule"], "runs": run_overview(state["runs"]),
                  "data": state.get("data"), "train_args": state.get("args")}
        report["draft_vocab"] = write_draft_vocab(state, args, out / "drafter")
    if not args.no_check:
        report["reference_check"] = reference_check.run(out, args.gguf, args.prompts, args.max_new_tokens,
                                                        torch.device("cpu" if args.smoke else args.device),
                                                        args.smoke)
    name = "check.json" if args.check_only else "metrics.json"
    (out / name).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    log(f"report written to {out / name}")
    failed = report.get("reference_check", {}).get("failures")
    if failed:
        raise SystemExit(f"reference check failed: {failed}")


if __name__ == "__main__":
    main()
