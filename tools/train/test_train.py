"""Unit tests for the training tools (CPU, tiny random models, a few seconds).

    .venv/bin/python -m unittest discover -s tools/train -p 'test_*.py'
"""

from __future__ import annotations

import unittest
from pathlib import Path

import numpy as np
import torch

import check_heldout
import draft_vocab
import drafter as dfl
import mtp as mtp_mod
import prompts
from export import drafter_tensors, mtp_tensors
from target import LlamaTarget, RmsNorm, TargetConfig, apply_rope, rope_cos_sin, to_hf_llama
from train_data import Samples, repeat_end, trim_repeats
from train_eval import simulate_rounds

TINY = TargetConfig(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                    vocab_size=128, rope_theta=10000.0, rms_norm_eps=1e-5, context_length=256, bos_id=1, eos_id=2,
                    chat_template="")


def tiny_drafter(seed: int = 0, random_convs: bool = True):
    cfg = dfl.draft_config(TINY, layers=2, intermediate_size=80, block_size=4, mask_token_id=5, conv_kernel_size=2,
                           conv_group_size=16, selector_rank=8, selector_top_k=4)
    model = dfl.make_drafter(cfg, seed).eval()
    if random_convs:
        # Non-identity convolutions and a non-zero selector, so the block-local taps are really exercised.
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "conv" in name or "successor" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def tiny_target(seed: int = 0) -> LlamaTarget:
    torch.manual_seed(seed)
    model = LlamaTarget(TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return model.eval()


class DrafterLayoutTests(unittest.TestCase):
    def test_block_layout_labels_are_same_position_tokens(self):
        ids = torch.arange(10, 20)[None]
        layout = dfl.block_layout(ids, torch.tensor([8]), torch.tensor([[3, 6, -1]]), 4, 99)
        self.assertEqual(layout.ids.view(3, 4)[0].tolist(), [13, 99, 99, 99])
        self.assertEqual(layout.pos.view(3, 4)[1].tolist(), [6, 7, 8, 9])
        self.assertEqual(layout.labels[0, 0].tolist(), [-100, 14, 15, 16])
        self.assertEqual(layout.labels[0, 1].tolist(), [-100, 17, -100, -100])  # the sequence has 8 tokens
        self.assertEqual(layout.labels[0, 2].tolist(), [-100] * 4)
        self.assertEqual(layout.kd_rows.tolist(), (layout.labels >= 0).tolist())  # all greedy: every label

    def test_attention_mask_sees_strictly_earlier_context_and_own_block(self):
        mask = dfl.attention_mask(torch.tensor([[2, 5, -1]]), torch.tensor([6]), 8, 2)[0, 0]
        self.assertEqual(mask.shape, (6, 8 + 6))
        self.assertEqual(mask[0, :8].tolist(), [True, True] + [False] * 6)
        self.assertEqual(mask[3, :8].tolist(), [True] * 5 + [False] * 3)
        self.assertEqual(mask[4, :8].tolist(), [False] * 8)
        self.assertEqual(mask[1, 8:].tolist(), [True, True, False, False, False, False])
        self.assertEqual(mask[5, 8:].tolist(), [False, False, False, False, True, True])

    def test_sample_anchors_are_distinct_response_positions(self):
        loss_mask = torch.zeros(2, 12, dtype=torch.bool)
        loss_mask[0, 4:10] = True
        loss_mask[1, 7:12] = True
        anchors = dfl.sample_anchors(loss_mask, torch.tensor([10, 12]), 8, torch.Generator().manual_seed(0))
        for row, (lo, hi) in enumerate(((4, 9), (7, 11))):
            got = [a for a in anchors[row].tolist() if a >= 0]
            self.assertEqual(got, list(range(lo, hi)))

    def test_leading_correct_stops_at_first_miss_or_missing_label(self):
        labels = torch.tensor([[[-100, 1, 1, 1], [-100, 1, -100, -100]]])
        rows = labels >= 0
        correct = torch.tensor([True, True, False, True])
        self.assertEqual(dfl.leading_correct(rows, correct).tolist(), [[2, 1]])

    def test_slot_weights_decay_from_slot_one(self):
        w = dfl.slot_weights(4, 4.0, "cpu")
        self.assertEqual(float(w[0]), 0.0)
        self.assertAlmostEqual(float(w[1]), 1.0)
        self.assertAlmostEqual(float(w[3]), float(np.exp(-0.5)), places=6)


class DrafterParityTests(unittest.TestCase):
    def test_packed_forward_equals_reference_forward_per_block(self):
        model = tiny_drafter()
        gen = torch.Generator().manual_seed(3)
        s, block = 20, 4
        taps = torch.randn(1, s, 2 * TINY.hidden_size, generator=gen) * 3
        ids = torch.randint(6, 128, (1, s), generator=gen)
        embed = torch.randn(128, TINY.hidden_size, generator=gen)
        anchors = torch.tensor([[3, 4, 11, 16]])
        lengths = torch.tensor([s])
        layout = dfl.block_layout(ids, lengths, anchors, block, 5)
        block_ids = layout.ids
        mask = dfl.attention_mask(anchors, lengths, s, block)
        with torch.no_grad():
            packed = dfl.packed_forward(model, taps, embed[block_ids], layout.pos, mask, block)
            for i, a in enumerate(anchors[0].tolist()):
                rows = slice(i * block, (i + 1) * block)
                ref = model(position_ids=torch.arange(a + block)[None], noise_embedding=embed[block_ids[:, rows]],
                            target_hidden=taps[:, :a])
                torch.testing.assert_close(packed[:, rows], ref, atol=1e-5, rtol=1e-5)

    def test_selector_walk_matches_reference_select(self):
        model = tiny_drafter()
        gen = torch.Generator().manual_seed(4)
        hidden = torch.randn(1, 3, TINY.hidden_size, generator=gen)
        logits = torch.randn(1, 3, 128, generator=gen) * 3
        anchor = torch.tensor([7])
        with torch.no_grad():
            path, _, _ = model.candidate_selector.select(hidden, logits, anchor, 0.0)
            previous = torch.cat([anchor, path[0, :-1]])
            unary, cand = torch.topk(logits[0], 4, dim=-1)
            scores = dfl.selector_scores(model.candidate_selector, hidden[0], unary, cand, previous)
        self.assertEqual(cand.gather(1, scores.argmax(-1, keepdim=True))[:, 0].tolist(), path[0].tolist())


class MtpTests(unittest.TestCase):
    def test_depth_masks_match_a_sequential_chain(self):
        head = mtp_mod.MtpHead(TINY).eval()
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in head.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
        s = 9
        emb = torch.randn(1, s, TINY.hidden_size, generator=gen)
        hidden = torch.randn(1, s, TINY.hidden_size, generator=gen)
        with torch.no_grad():
            outs = head.forward_depths(emb, hidden, 3)
            for start in (0, 3, 6):
                chain = sequential_chain(head, emb, hidden, start, 3)
                for d, out in enumerate(chain, start=1):
                    torch.testing.assert_close(outs[d - 1][:, start + d - 1], out, atol=1e-5, rtol=1e-5)

    def test_chain_accept_counts_leading_depths(self):
        hit1 = torch.tensor([[True, True, False, True]])
        hit2 = torch.tensor([[False, True, True, False]])
        valid = torch.ones(1, 4, dtype=torch.bool)
        accepted, _ = mtp_mod.chain_accept([(hit1, valid), (hit2, valid)])
        self.assertEqual(accepted.tolist(), [[2, 2, 0, 1]])


def sequential_chain(head, emb, hidden, start, depth):
    """What inference does: cache the committed entries 0..start, then chain one entry at a time."""
    layer = head.layers[0]
    keys, values, outputs = [], [], []
    positions = torch.arange(emb.shape[1])[None]
    cos, sin = rope_cos_sin(positions, TINY.head_dim, TINY.rope_theta, emb.dtype)
    x = head.combine(emb[:, : start + 1], hidden[:, : start + 1])
    q, k, v = layer.qkv(layer.input_layernorm(x), cos[:, : start + 1], sin[:, : start + 1])
    keys.append(k)
    values.append(v)
    causal = torch.ones(start + 1, start + 1, dtype=torch.bool).tril()
    previous = head.norm(layer.finish(x, layer.attend(q, k, v, mask=causal)))[:, -1:]
    outputs.append(previous[:, 0])
    for d in range(2, depth + 1):
        j = start + d - 1
        x = head.combine(emb[:, j: j + 1], previous)
        q, k, v = layer.qkv(layer.input_layernorm(x), cos[:, j: j + 1], sin[:, j: j + 1])
        keys.append(k)
        values.append(v)
        attn = layer.attend(q, torch.cat(keys, 2), torch.cat(values, 2))
        previous = head.norm(layer.finish(x, attn))
        outputs.append(previous[:, 0])
    return outputs


class TargetTests(unittest.TestCase):
    def test_capture_matches_transformers_llama(self):
        model = tiny_target()
        state = {f"model.{k}": v for k, v in model.state_dict().items()}
        hf = to_hf_llama(TINY, state)
        ids = torch.randint(0, 128, (2, 11))
        with torch.no_grad():
            ref = hf(ids, output_hidden_states=True)
        final, taps = model.capture(ids, [0, 1])
        torch.testing.assert_close(model.logits(final), ref.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(taps[1], ref.hidden_states[2], atol=1e-4, rtol=1e-4)

    def test_batched_left_padded_generation_equals_one_by_one(self):
        model = tiny_target(1)
        prompts_ = [[5, 9, 11], [7, 3, 30, 31, 40, 41], [8]]
        batched = model.generate(prompts_, 6, 0.0)
        single = [model.generate([p], 6, 0.0)[0] for p in prompts_]
        self.assertEqual(batched, single)

    def test_rms_norm_and_rope_equal_the_textbook_formulas(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(3, 5, 64, generator=gen) * 4
        norm = RmsNorm(64, 1e-5)
        norm.weight.data = torch.randn(64, generator=gen)
        expected = norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        torch.testing.assert_close(norm(x), expected, atol=1e-6, rtol=1e-6)
        q = torch.randn(3, 4, 5, 64, generator=gen)
        cos, sin = rope_cos_sin(torch.randint(0, 2048, (3, 5), generator=gen), 64, 100000.0, torch.float32)
        rotated = torch.cat([-q[..., 32:], q[..., :32]], dim=-1)  # rotate_half
        torch.testing.assert_close(apply_rope(q, cos, sin), q * cos[:, None] + rotated * sin[:, None],
                                   atol=1e-6, rtol=1e-6)


class EvalAndDataTests(unittest.TestCase):
    def test_simulate_rounds_walks_accepted_runs(self):
        accept = np.array([0, 0, 3, 0, 0, 0, 1, 0, 0, 0])
        self.assertEqual(simulate_rounds(accept, 2, 10, 7), [(3, 4), (1, 2), (0, 1)])
        # Three tokens are left after position 1: two drafts and the bonus, whatever more the drafter had right.
        self.assertEqual(simulate_rounds(np.array([0, 5, 0, 0, 0]), 1, 5, 7), [(2, 3)])

    def test_repeat_end_finds_the_first_repeated_run(self):
        loop = [7, 8, 9]
        response = np.array([1, 2, 3, 4] + loop * 5)
        # The run [7, 8, 9] starts at 4 and again at 7: cut just past its second occurrence.
        self.assertEqual(repeat_end(response, 3), 10)
        self.assertIsNone(repeat_end(np.arange(40), 3))  # no run repeats
        self.assertIsNone(repeat_end(response, 0))
        self.assertIsNone(repeat_end(np.array([5, 5, 5]), 2))  # shorter than two runs

    def test_trim_repeats_cuts_responses_only_and_counts_what_it_removed(self):
        prompt = np.array([4, 4, 4, 4, 4, 4])  # a repeat inside the prompt is not the response's
        looped = np.concatenate([prompt, [1, 2] + [7, 8, 9] * 6])
        clean = np.concatenate([prompt, np.arange(10, 30)])
        samples = Samples([looped.copy(), clean.copy()], np.array([6, 6]), np.array([6, 6]), np.zeros(2, int), {})
        self.assertEqual(trim_repeats(samples, [0, 1], 3), (1, 12))
        np.testing.assert_array_equal(samples.sequences[0], np.concatenate([prompt, [1, 2, 7, 8, 9, 7, 8, 9]]))
        np.testing.assert_array_equal(samples.sequences[1], clean)

    def test_overlap_check_finds_copies_and_near_copies(self):
        train = [{"id": "a", "prompt": "Why do cats purr when they are happy and calm?"},
                 {"id": "b", "prompt": " ".join(f"w{i}" for i in range(40))}]
        evals = {"x.json": ["why do cats purr when they are happy and calm ?",
                            "Intro. " + " ".join(f"w{i}" for i in range(5, 30)),
                            "A completely different question about tides."]}
        found = check_heldout.overlap_findings(evals, train)
        self.assertTrue(any("x.json[0]" in f for f in found))
        self.assertTrue(any("x.json[1]" in f and "run" in f for f in found))
        self.assertFalse(any("x.json[2]" in f for f in found))

    def test_prompt_set_is_deterministic(self):
        a = prompts.build(0, prompts.SMOKE_COUNTS, smoke=True)
        b = prompts.build(0, prompts.SMOKE_COUNTS, smoke=True)
        self.assertEqual(prompts.sha256_of(a), prompts.sha256_of(b))
        self.assertEqual({r["group"] for r in a}, set(prompts.SMOKE_COUNTS))
        conversations = [r for r in a if r["group"] == "multiturn"]
        self.assertTrue(conversations and all(1 <= len(r["followups"]) <= 2 for r in conversations))
        self.assertTrue(all(r["source"].startswith("source:") for r in a if r["group"] == "source"))

    def test_overlap_check_reads_follow_up_turns(self):
        train = [{"id": "m", "prompt": "Tell me about tides.", "followups": ["Why do cats purr when happy and calm?"]}]
        found = check_heldout.overlap_findings({"x.json": ["why do cats purr when happy and calm?"]}, train)
        self.assertTrue(any("x.json[0]" in f and "equals" in f for f in found))

    def test_exported_weights_read_back_under_the_training_names(self):
        import tempfile

        from safetensors.torch import save_file

        from export import read_drafter, read_mtp
        model = tiny_drafter()
        state = model.state_dict()
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            (folder / "config.json").write_text('{"dtype": "bfloat16", "hidden_size": 64}', encoding="utf-8")
            save_file(drafter_tensors(state), str(folder / "model.safetensors"))
            config, back = read_drafter(folder)
            self.assertEqual(config, {"hidden_size": 64})
            self.assertEqual(set(back), set(state))
            for name, value in state.items():
                torch.testing.assert_close(back[name], value.to(torch.bfloat16).float(), rtol=0, atol=0)
            model.load_state_dict(back)  # the names and shapes are the training model's
            (folder / "mtp").mkdir()
            save_file(mtp_tensors({"fc.weight": torch.ones(2, 2)}), str(folder / "mtp" / "model.safetensors"))
            self.assertEqual(set(read_mtp(folder / "mtp")), {"fc.weight"})

    def test_a_resumed_series_keeps_its_trim_window(self):
        import argparse

        import train
        state = {"target_config": {"num_layers": 3, "hidden_size": 64}, "schedule": {"total_steps": 10},
                 "drafter_config": {}, "mtp_state": None, "mtp_depth_weights": [1.0]}
        args = argparse.Namespace(total_steps=0, trim_repeats=None)
        self.assertEqual(train.resumed_configs(args, state, TINY)["trim_repeats"], 0)  # recorded before trimming
        self.assertEqual(train.resumed_configs(args, dict(state, trim_repeats=32), TINY)["trim_repeats"], 32)
        with self.assertRaises(SystemExit):  # another window would make the cursor and the counts see new data
            train.resumed_configs(argparse.Namespace(total_steps=0, trim_repeats=32), state, TINY)

    def test_export_names(self):
        state = {"candidate_selector.predecessor_codebook.weight": torch.zeros(2, 2), "fc.weight": torch.ones(2, 2)}
        names = set(drafter_tensors(state))
        self.assertEqual(names, {"candidate_selector.predecessor_codebook", "fc.weight"})
        self.assertEqual(set(mtp_tensors({"fc.weight": torch.ones(1)})), {"mtp.fc.weight"})


class DraftVocabTests(unittest.TestCase):
    def test_ranking_puts_control_tokens_first_then_frequency(self):
        response = np.array([0, 5, 1, 9, 0, 0, 3, 0])
        prompt = np.array([0, 0, 0, 0, 4, 2, 0, 0])
        ranking = draft_vocab.rank(response, prompt, control=[7, 1])
        # Controls 1 (count 5) and 7 (count 0); then by response count; unseen 4, 5, 0 by prompt count.
        self.assertEqual(ranking.tolist(), [1, 7, 3, 6, 2, 4, 5, 0])
        self.assertEqual(ranking.dtype, np.int32)
        cov = draft_vocab.coverage(ranking, response, sizes=(2, 4, 16))
        self.assertEqual(cov, {"2": round(5 / 18, 6), "4": round(17 / 18, 6)})

    def test_counts_split_prompt_and_response_tokens_and_the_file_reads_back(self):
        import tempfile
        from safetensors import safe_open

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "samples.npz"
            np.savez(path, tokens=np.array([1, 2, 3, 3, 4, 1, 4], dtype=np.uint16), offsets=np.array([0, 4, 7]),
                     prompt_len=np.array([2, 1], dtype=np.int32))
            response, prompt = draft_vocab.token_counts(path, vocab=6)
            self.assertEqual(response.tolist(), [0, 1, 0, 2, 1, 0])
            self.assertEqual(prompt.tolist(), [0, 1, 1, 0, 1, 0])
            written = draft_vocab.write(Path(tmp) / "drafter", np.array([2, 0, 1], dtype=np.int32), 2, {"x": "y"})
            with safe_open(str(written), "np") as f:
                self.assertEqual(f.get_tensor("token_ids").tolist(), [2, 0, 1])
                self.assertEqual(f.metadata()["default_size"], "2")


if __name__ == "__main__":
    unittest.main()
