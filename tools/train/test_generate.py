"""Unit tests of the data generator: the decode pool, sampled prefixes, shards and the sample format (CPU, tiny
random target, about a second).

    .venv/bin/python -m unittest discover -s tools/train -p 'test_*.py'
"""

from __future__ import annotations

import tempfile
import unittest
import warnings
from unittest import mock
from pathlib import Path

import numpy as np
import torch

import generate
from decode_pool import KEY_BUCKET, DecodeGraphs, DecodePool, Job, decode_mask
from test_train import tiny_target
from train_data import SPLIT_HELDOUT, SPLIT_TRAIN, load_samples

torch.set_num_threads(1)


def random_prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (count,), generator=gen)
    return [torch.randint(3, 128, (int(n),), generator=gen).tolist() for n in lengths]


class DecodePoolTests(unittest.TestCase):
    def test_pool_equals_one_prompt_at_a_time(self):
        model = tiny_target(1)
        prompts = random_prompts(9)
        reference = [model.generate([p], 10, 0.0)[0] for p in prompts]
        # Fewer rows than prompts: rows are refilled as others end (EOS or 10 tokens).
        results = DecodePool(model, rows=3, max_prompt=16, max_new=10, check_every=2).run([Job(p) for p in prompts])
        self.assertEqual([r.tokens for r in results], reference)
        self.assertEqual([r.ended for r in results], [r[-1] == model.cfg.eos_id for r in reference])

    def test_a_profiled_pool_gives_the_same_tokens(self):
        model = tiny_target(1)
        prompts = random_prompts(6, seed=3)
        plain = DecodePool(model, rows=2, max_prompt=16, max_new=40, check_every=2).run([Job(p) for p in prompts])
        profiled = DecodePool(model, rows=2, max_prompt=16, max_new=40, check_every=2, profile_steps=3)
        with mock.patch("builtins.print") as printed:
            results = profiled.run([Job(p) for p in prompts])
        self.assertEqual([r.tokens for r in results], [r.tokens for r in plain])
        self.assertIn("profile of 3 decode steps", printed.call_args_list[0].args[0])

    def test_graphed_decode_replays_from_static_inputs_and_falls_back_to_eager(self):
        # No CUDA here: a stand-in graph reruns the step from the static inputs into its static output, as a
        # replay does; compactions (new rows) capture anew; a failed capture warns once and stays eager.
        def stand_in(graphs, end):
            logits = graphs.eager(graphs.cur, graphs.pos, end)
            return mock.Mock(replay=lambda: logits.copy_(graphs.eager(graphs.cur, graphs.pos, end))), logits

        def failing(graphs, end):
            raise RuntimeError("operation not permitted when stream is capturing")

        model = tiny_target(1)
        jobs = [Job(p) for p in random_prompts(7, seed=4)]
        plain = DecodePool(model, rows=4, max_prompt=16, max_new=12, check_every=2).run(jobs)
        for capture in (stand_in, failing):
            with mock.patch.object(DecodeGraphs, "_capture", capture), warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("always")
                pool = DecodePool(model, rows=4, max_prompt=16, max_new=12, check_every=2)
                pool.decode = DecodeGraphs(pool._decode)
                results = pool.run(jobs)
            self.assertEqual([r.tokens for r in results], [r.tokens for r in plain])
            self.assertEqual(len(warned), 0 if capture is stand_in else 1)

    def test_sampled_prefix_then_greedy(self):
        model = tiny_target(1)
        prompts = random_prompts(6, seed=1)
        pool = DecodePool(model, rows=4, max_prompt=16, max_new=10, check_every=3, seed=5)
        results = pool.run([Job(p, sampled=3, temperature=2.0) for p in prompts])
        greedy = [model.generate([p], 10, 0.0)[0] for p in prompts]
        self.assertNotEqual([r.tokens for r in results], greedy)  # the prefixes were sampled
        for prompt, result in zip(prompts, results, strict=True):
            prefix = result.tokens[:3]
            if model.cfg.eos_id in prefix:
                continue
            continuation = model.generate([prompt + prefix], 7, 0.0)[0]
            self.assertEqual(result.tokens[3:], continuation)

    def test_bucketed_key_length_attends_like_the_exact_one(self):
        layer = tiny_target(1).layers[0]
        gen = torch.Generator().manual_seed(2)
        pos = torch.tensor([3, 40, 129, 7])
        keys, values = (torch.randn(4, 2, 256, 16, generator=gen) * 1e3 for _ in range(2))  # stale past pos
        q = torch.randn(4, 4, 1, 16, generator=gen)
        exact = layer.attend(q, keys[:, :, :130], values[:, :, :130], mask=decode_mask(pos, 130, torch.float32))
        bucketed = layer.attend(q, keys, values, mask=decode_mask(pos, 256, torch.float32))
        torch.testing.assert_close(bucketed, exact, atol=1e-6, rtol=1e-6)
        for row, p in enumerate(pos.tolist()):  # each row sees exactly its slots 0..pos
            alone = layer.attend(q[row:row + 1], keys[row:row + 1, :, : p + 1], values[row:row + 1, :, : p + 1])
            torch.testing.assert_close(bucketed[row:row + 1], alone, atol=1e-6, rtol=1e-6)

    def test_key_length_rounds_up_to_a_bucket_within_the_cache(self):
        pool = DecodePool(tiny_target(1), rows=3, max_prompt=300, max_new=10, check_every=2)
        pool.active[:] = [True, True, False]
        for longest, expected in ((0, KEY_BUCKET), (KEY_BUCKET - 1, KEY_BUCKET), (KEY_BUCKET, 2 * KEY_BUCKET),
                                  (pool.slots - 1, pool.slots)):
            pool.length[:] = [longest, 1, pool.slots - 1]  # an inactive row's length does not count
            self.assertEqual(pool._key_length(), expected)

    def test_deadline_leaves_jobs_unstarted(self):
        model = tiny_target(1)
        results = DecodePool(model, rows=2, max_prompt=16, max_new=4, check_every=2).run(
            [Job(p) for p in random_prompts(5)], deadline=0.0)
        self.assertEqual(sum(r is None for r in results), 3)  # the first two rows still finish


class SelectionTests(unittest.TestCase):
    def test_shards_partition_training_prompts_and_heldout_is_fixed(self):
        records = [{"id": f"chat-{i:05d}", "group": "chat", "prompt": str(i)} for i in range(4000)]
        shards = [generate.select_records(records, s, 3, eval_prompts=5) for s in range(3)]
        train_ids = [{r["id"] for r in shard if r["split"] == SPLIT_TRAIN} for shard in shards]
        heldout = [[r["id"] for r in shard if r["split"] == SPLIT_HELDOUT] for shard in shards]
        self.assertEqual(sum(len(t) for t in train_ids), len(set().union(*train_ids)))
        self.assertEqual(heldout[0], heldout[1])
        self.assertEqual(len(heldout[0]), 5)
        everything = set().union(*train_ids) | {r["id"] for r in records if generate.is_heldout(r["id"])}
        self.assertEqual(everything, {r["id"] for r in records})
        self.assertFalse(set(heldout[0]) & set().union(*train_ids))

    def test_conversation_alternates_user_and_assistant_turns(self):
        conv = generate.Conversation({"prompt": "a", "followups": ["b", "c"], "split": 0})
        self.assertEqual(conv.messages(), [{"role": "user", "content": "a"}])
        conv.replies.append("A")
        self.assertEqual([m["role"] for m in conv.messages()], ["user", "assistant", "user"])
        self.assertEqual(conv.messages()[-1]["content"], "b")
        self.assertEqual(conv.turn, 1)


class SampleFormatTests(unittest.TestCase):
    def test_saved_samples_load_with_their_greedy_start_and_split(self):
        record = {"row": 3, "split": SPLIT_TRAIN, "group": "chat"}
        samples = [
            {"record": record, "prompt": [5, 6, 7], "response": [8, 9, 2], "greedy_from": 0, "temperature": 0.0,
             "turn": 0, "ended": True},
            {"record": {**record, "split": SPLIT_HELDOUT}, "prompt": [5, 6], "response": [10, 11, 12, 13],
             "greedy_from": 2, "temperature": 0.7, "turn": 1, "ended": False},
        ]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "samples.npz"
            generate.save(path, samples, {"samples": 2})
            loaded = load_samples(path)
        self.assertEqual([s.tolist() for s in loaded.sequences], [[5, 6, 7, 8, 9, 2], [5, 6, 10, 11, 12, 13]])
        self.assertEqual(loaded.greedy_start.tolist(), [3, 4])
        self.assertEqual(loaded.split.tolist(), [SPLIT_TRAIN, SPLIT_HELDOUT])
        self.assertTrue(loaded.is_pure_greedy(0))
        self.assertFalse(loaded.is_pure_greedy(1))
        self.assertIsInstance(loaded.prompt_len, np.ndarray)


if __name__ == "__main__":
    unittest.main()
