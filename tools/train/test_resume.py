"""Unit tests of resumable training: the step-based schedule, checkpoints, and exact continuation (CPU, tiny
random models, a few seconds).

    .venv/bin/python -m unittest discover -s tools/train -p 'test_*.py'
"""

from __future__ import annotations

import tempfile
import unittest
from pathlib import Path

import numpy as np
import torch

import checkpoint as ckpt
import distill
import drafter as dfl
import mtp as mtp_mod
from test_train import TINY, tiny_target
from train_data import BatchCursor, Samples
from trainer import TrainConfig, Trainer

torch.set_num_threads(1)


def tiny_samples(count: int = 12, seed: int = 0) -> Samples:
    """Random sequences; every third has a sampled prefix of three response tokens."""
    rng = np.random.default_rng(seed)
    seqs, prompt_len, greedy_start = [], [], []
    for i in range(count):
        p, n = int(rng.integers(4, 8)), int(rng.integers(14, 24))
        seqs.append(rng.integers(6, TINY.vocab_size, n).astype(np.int64))
        prompt_len.append(p)
        greedy_start.append(p + (3 if i % 3 == 0 else 0))
    return Samples(seqs, np.array(prompt_len), np.array(greedy_start), np.zeros(count, dtype=np.int64), {})


def tiny_config(total_steps: int = 20) -> TrainConfig:
    sched = ckpt.schedule_config("wsd", total_steps, 3, 0.3, 2e-3, 0.1)
    return TrainConfig(block_size=4, target_layer_ids=[0, 2], mask_token_id=5, selector_top_k=4, pad_id=2,
                       schedule=sched, loss=distill.LossConfig("kd+ce", 8, 0.1), mtp_weights=[1.0, 0.5],
                       anchors_per_seq=6, batch_tokens=80, batch_anchors=18, seed=3)


def fresh_models(target, state: dict | None = None):
    cfg = dfl.draft_config(TINY, layers=1, intermediate_size=48, block_size=4, mask_token_id=5, conv_kernel_size=2,
                           conv_group_size=16, selector_rank=8, selector_top_k=4, target_layer_ids=[0, 2])
    drafter = dfl.make_drafter(cfg, 0)
    head = mtp_mod.MtpHead(TINY)
    mtp_mod.init_from_target(head, target, 0)
    if state is not None:
        drafter.load_state_dict({k: v.float() for k, v in state["drafter_state"].items()})
        head.load_state_dict({k: v.float() for k, v in state["mtp_state"].items()})
    return drafter, head


def make_trainer(target, samples, state=None) -> Trainer:
    drafter, head = fresh_models(target, state)
    return Trainer(target, drafter, head, tiny_config(), samples, list(range(len(samples))), torch.device("cpu"),
                   resume=state)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {f"d.{k}": v.clone() for k, v in trainer.drafter.state_dict().items()} | \
        {f"m.{k}": v.clone() for k, v in trainer.head.state_dict().items()}


def quiet(_msg: str) -> None:
    pass


class ScheduleTests(unittest.TestCase):
    def test_wsd_warms_up_holds_then_decays_to_the_floor(self):
        sched = ckpt.schedule_config("wsd", 100, 10, 0.2, 1.0, 0.05)
        lrs = [ckpt.lr_at(s, sched) for s in range(110)]
        self.assertAlmostEqual(lrs[0], 0.1)
        self.assertEqual(lrs[10:80], [1.0] * 70)
        self.assertTrue(all(a >= b for a, b in zip(lrs[80:100], lrs[81:100], strict=False)))
        self.assertAlmostEqual(lrs[99], 0.05 + 0.95 / 20, places=6)
        self.assertEqual(lrs[100:], [0.05] * 10)

    def test_cosine_ends_at_the_floor(self):
        sched = ckpt.schedule_config("cosine", 50, 5, 0.0, 2.0, 0.1)
        self.assertAlmostEqual(ckpt.lr_at(5, sched), 2.0)
        self.assertAlmostEqual(ckpt.lr_at(50, sched), 0.2)
        self.assertLess(ckpt.lr_at(40, sched), ckpt.lr_at(20, sched))


class CompactMomentTests(unittest.TestCase):
    def test_log_quantised_second_moment_round_trips_within_three_percent(self):
        gen = torch.Generator().manual_seed(0)
        v = torch.exp(torch.randn(50, 40, generator=gen) * 4) * 1e-6  # ~20 octaves of sqrt(v)
        v[0, :5] = 0.0
        back = ckpt.dequantize_second_moment(ckpt.quantize_second_moment(v))
        self.assertTrue(bool((back[0, :5] == 0).all()))
        ratio = (back[v > 0] / v[v > 0]).sqrt()
        self.assertLess(float((ratio - 1).abs().max()), 0.03)

    def test_all_zero_tensor(self):
        back = ckpt.dequantize_second_moment(ckpt.quantize_second_moment(torch.zeros(3, 2)))
        self.assertEqual(back.tolist(), [[0.0, 0.0]] * 3)


class CursorTests(unittest.TestCase):
    def test_cursor_resumes_the_same_batch_sequence(self):
        samples = tiny_samples()
        sizes = tiny_config().batch_sizes()
        first = BatchCursor(samples, list(range(12)), 1, sizes)
        straight = [first.next() for _ in range(9)]
        again = BatchCursor(samples, list(range(12)), 1, sizes)
        head = [again.next() for _ in range(4)]
        resumed = BatchCursor(samples, list(range(12)), 1, sizes, again.state())
        self.assertEqual(head + [resumed.next() for _ in range(5)], straight)
        other = BatchCursor(tiny_samples(seed=1), list(range(12)), 1, sizes, again.state())
        self.assertEqual((other.epoch, other.position), (0, 0))  # new data starts at its beginning


class ResumeTests(unittest.TestCase):
    def test_resumed_training_equals_uninterrupted_training(self):
        target, samples = tiny_target(2), tiny_samples()
        straight = make_trainer(target, samples)
        straight.run(6, float("inf"), 100, quiet)
        first = make_trainer(target, samples)
        first.run(3, float("inf"), 100, quiet)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "train_state.pt"
            ckpt.save(path, first.checkpoint_state() | {"runs": []}, compact=False)
            resumed = make_trainer(target, samples, ckpt.load(path))
        resumed.run(3, float("inf"), 100, quiet)
        self.assertEqual(resumed.step, 6)
        a, b = weights(straight), weights(resumed)
        for name in a:
            self.assertTrue(torch.equal(a[name], b[name]), name)

    def test_compact_checkpoint_is_small_and_resumes(self):
        target, samples = tiny_target(2), tiny_samples()
        first = make_trainer(target, samples)
        first.run(3, float("inf"), 100, quiet)
        with tempfile.TemporaryDirectory() as tmp:
            exact = ckpt.save(Path(tmp) / "a.pt", first.checkpoint_state(), compact=False)
            compact = ckpt.save(Path(tmp) / "b.pt", first.checkpoint_state(), compact=True)
            state = ckpt.load(Path(tmp) / "b.pt")
        params = sum(p.numel() for p in first.params)
        self.assertLess(compact, exact / 3)
        self.assertLess(compact, ckpt.compact_bytes_estimate(params) + 400_000)  # + names, configs, rng states
        resumed = make_trainer(target, samples, state)
        self.assertEqual(resumed.step, 3)
        moments = [resumed.optimizer.state[p]["exp_avg_sq"] for p in resumed.params]
        self.assertTrue(any(bool((m > 0).any()) for m in moments))
        stats = resumed.run(2, float("inf"), 1, quiet)
        self.assertTrue(all(np.isfinite(s["loss"]) for s in stats))


if __name__ == "__main__":
    unittest.main()
