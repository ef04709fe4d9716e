"""Shared pieces of the golden-fixture generator: paths, fixed inputs, seeded weight init, reference runs.

Everything here is deterministic: weights come from a seeded torch.Generator, inputs are literal byte strings,
and every reference forward is a batch-1 f32 CPU run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURES_DIR = REPO_ROOT / "crates" / "models" / "tests" / "fixtures"

# Two fixed 12-token sequences. The tiny models have a 256-entry vocabulary, so the UTF-8 bytes of a
# 12-character ASCII string are valid token ids (and, for the tiny GGUF's byte-level tokenizer, the bytes
# of "Hello world!" are exactly its tokenization).
SEQUENCES: list[list[int]] = [list(b"Hello world!"), list(b"dflash tests")]
SEQ_LEN = 12
# Start position of the second pass over sequence 0 (positions 100..111): beyond the llama3 / yarn
# original context (32 / 64) but inside max_position_embeddings (256).
OFFSET_START = 100
GREEDY_NEW_TOKENS = 16
# An 80-token seeded random sequence run from position 0. Rope is relative, so only long *distances* exercise
# the scaled (llama3 / yarn) low frequencies beyond the original context of 32 / 64 positions.
LONG_SEQ_LEN = 80
LONG_SEQUENCE: list[int] = np.random.default_rng(seed=80).integers(0, 256, size=LONG_SEQ_LEN).tolist()

# Weight scales of the random tiny models. Layer matrices use std 0.1; embeddings / lm_head use a larger
# std so the logits are spread (std ~2) and greedy argmaxes are not near-ties that float rounding could flip.
MATRIX_STD = 0.1
EMBED_STD = 0.25
# RMSNorm weights are 1 + N(0, NORM_JITTER) so a loader that ignores them fails the parity test.
NORM_JITTER = 0.1

assert all(len(s) == SEQ_LEN for s in SEQUENCES)


def set_determinism() -> None:
    """Fixes torch's global RNG and asks for deterministic kernels (CPU f32 throughout).

    One intra-op thread, so the summation order (and the last bits of the goldens) does not depend on the
    machine's core count or load.
    """
    torch.set_num_threads(1)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)


def reset_dir(path: Path) -> Path:
    """Empties (or creates) one fixture folder so stale files from an earlier run never linger."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    """Overwrites every parameter with seeded random values, visiting them in sorted-name order.

    1-D parameters are norm weights (1 + jitter); embeddings and lm_head get EMBED_STD; every other
    matrix gets MATRIX_STD. Tied parameters are one tensor and are written once.
    """
    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(remove_duplicate=True)):
            if id(param) in seen:
                continue
            seen.add(id(param))
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.ndim == 1:
                param.copy_(1.0 + NORM_JITTER * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                param.copy_(EMBED_STD * noise)
            else:
                param.copy_(MATRIX_STD * noise)


def _layer_output(output) -> torch.Tensor:
    """A decoder layer returns a tensor in recent transformers and a tuple (hidden, ...) in older ones."""
    return output[0] if isinstance(output, tuple) else output


def forward_with_layer_taps(model, ids: list[int], position_start: int = 0):
    """Batch-1 forward of `ids` at positions position_start.. with forward hooks on every decoder layer.

    Returns (logits [T, V], taps: list of [T, H] per layer = the layer's output before the final norm,
    hf_hidden_states: transformers' output_hidden_states tuple, kept for the indexing cross-check).
    """
    taps: dict[int, torch.Tensor] = {}
    handles = []
    for index, layer in enumerate(model.model.layers):
        def hook(_module, _inputs, output, index=index):
            taps[index] = _layer_output(output).detach().clone()
        handles.append(layer.register_forward_hook(hook))
    try:
        input_ids = torch.tensor([ids], dtype=torch.long)
        position_ids = torch.arange(position_start, position_start + len(ids), dtype=torch.long).unsqueeze(0)
        with torch.no_grad():
            out = model(input_ids=input_ids, position_ids=position_ids, output_hidden_states=True, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    layer_outputs = [taps[i][0] for i in range(len(model.model.layers))]
    return out.logits[0].float(), layer_outputs, out.hidden_states


def check_hidden_state_indexing(model, layer_outputs, hf_hidden_states) -> str:
    """Cross-checks the hook taps against output_hidden_states and says how the last entry relates.

    hidden_states[0] is the embedding output; hidden_states[L + 1] must equal the hook on layer L for every
    layer but the last. The last entry is either the raw last-layer output or that output after model.norm,
    depending on the transformers version: the fixtures always use the hook, so either is fine.
    """
    n_layers = len(layer_outputs)
    assert len(hf_hidden_states) == n_layers + 1, f"expected {n_layers + 1} hidden states"
    for layer in range(n_layers - 1):
        torch.testing.assert_close(hf_hidden_states[layer + 1][0], layer_outputs[layer], rtol=0, atol=0)
    last_hf = hf_hidden_states[n_layers][0]
    last_tap = layer_outputs[-1]
    with torch.no_grad():
        normed = model.model.norm(last_tap.unsqueeze(0))[0]
    if torch.equal(last_hf, last_tap):
        return "hidden_states[L+1] == layer L output for all L (last entry is un-normed)"
    if torch.allclose(last_hf, normed, rtol=0, atol=1e-6):
        return "hidden_states[L+1] == layer L output for L < last; last entry has model.norm applied"
    raise AssertionError("last hidden state matches neither the raw nor the normed last-layer output")


def greedy_continuation(model, ids: list[int], n_new: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with the KV cache, exactly n_new tokens (an EOS does not stop it).

    Returns (new token ids, the logits [V] each token was chosen from).
    """
    tokens: list[int] = []
    step_logits: list[torch.Tensor] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True)
        for _ in range(n_new):
            logits = out.logits[0, -1].float()
            next_id = int(torch.argmax(logits))
            tokens.append(next_id)
            step_logits.append(logits)
            out = model(
                input_ids=torch.tensor([[next_id]], dtype=torch.long),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    return tokens, step_logits


def top2_gap(logits: torch.Tensor) -> float:
    """Difference between the largest and second-largest logit (how safe the argmax is)."""
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def save_golden(path: Path, tensors: dict[str, np.ndarray], description: dict[str, object]) -> None:
    """Writes a golden safetensors file with one metadata entry, "golden": `description` as sorted JSON.

    A single metadata key because safetensors keeps metadata in a hash map whose serialisation order varies
    from process to process; with one key the file bytes are reproducible (tensor order is fixed by the format).
    """
    contiguous = {name: np.ascontiguousarray(value) for name, value in tensors.items()}
    metadata = {"golden": json.dumps(description, sort_keys=True, ensure_ascii=False)}
    save_file(contiguous, str(path), metadata=metadata)


def describe_dir(path: Path) -> list[str]:
    """Lines 'name  size' for every file under a fixture folder (for the run summary)."""
    return [f"{p.relative_to(FIXTURES_DIR)}  {p.stat().st_size} B" for p in sorted(path.rglob("*")) if p.is_file()]
