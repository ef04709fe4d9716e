"""Unit tests of the distillation losses and of which rows see which data (CPU, tiny tensors, well under a second).

    .venv/bin/python -m unittest discover -s tools/train -p 'test_*.py'
"""

from __future__ import annotations

import unittest

import torch

import distill
import drafter as dfl
import mtp as mtp_mod
from test_train import TINY, tiny_drafter

torch.set_num_threads(1)


def dense_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """The textbook forward KL per row, in f64."""
    p = torch.softmax(teacher_logits.double(), -1)
    log_ratio = torch.log_softmax(teacher_logits.double(), -1) - torch.log_softmax(student_logits.double(), -1)
    return (p * log_ratio).sum(-1)


def coarse_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, k: int) -> torch.Tensor:
    """KL between the (k+1)-outcome distributions: the teacher's top-k tokens, and everything else."""
    p = torch.softmax(teacher_logits.double(), -1)
    q = torch.softmax(student_logits.double(), -1)
    idx = p.topk(k, -1).indices
    p_top, q_top = p.gather(1, idx), q.gather(1, idx)
    p_all = torch.cat([p_top, 1 - p_top.sum(-1, keepdim=True)], -1)
    q_all = torch.cat([q_top, 1 - q_top.sum(-1, keepdim=True)], -1)
    return (p_all * (p_all.log() - q_all.log())).sum(-1)


def teacher_for(logits: torch.Tensor, k: int) -> distill.RowTargets:
    """Row targets of teacher logits [R, V] through the same code as training (hidden = logits, embed = I)."""
    rows, vocab = logits.shape
    final = logits[None]
    teacher = distill.Teacher(final, torch.eye(vocab), torch.ones(1, rows, dtype=torch.bool), k)
    return teacher.rows(torch.zeros(rows, dtype=torch.long), torch.arange(rows))


class KlTests(unittest.TestCase):
    def setUp(self):
        gen = torch.Generator().manual_seed(0)
        self.teacher = torch.randn(6, 12, generator=gen) * 3
        self.student = torch.randn(6, 12, generator=gen) * 3

    def test_zero_when_the_drafter_equals_the_teacher(self):
        for k in (0, 3, 12):
            kl = distill.row_kl(self.teacher.clone(), teacher_for(self.teacher, k))
            torch.testing.assert_close(kl, torch.zeros(6), atol=1e-6, rtol=0)

    def test_dense_and_full_topk_match_the_textbook_kl(self):
        ref = dense_kl(self.teacher, self.student).float()
        for k in (0, 12):
            torch.testing.assert_close(distill.row_kl(self.student, teacher_for(self.teacher, k)), ref,
                                       atol=1e-5, rtol=1e-5)

    def test_topk_is_the_kl_of_the_coarse_grained_distributions(self):
        for k in (1, 4, 11):
            got = distill.row_kl(self.student, teacher_for(self.teacher, k))
            torch.testing.assert_close(got, coarse_kl(self.teacher, self.student, k).float(), atol=1e-5, rtol=1e-5)
            self.assertTrue(bool((got <= dense_kl(self.teacher, self.student).float() + 1e-5).all()))

    def test_dense_gradient_is_student_minus_teacher_probabilities(self):
        student = self.student.clone().requires_grad_(True)
        distill.row_kl(student, teacher_for(self.teacher, 0)).sum().backward()
        expected = torch.softmax(self.student, -1) - torch.softmax(self.teacher, -1)
        torch.testing.assert_close(student.grad, expected, atol=1e-5, rtol=1e-5)

    def test_full_topk_gradient_is_finite_and_matches_dense(self):
        student = self.student.clone().requires_grad_(True)
        distill.row_kl(student, teacher_for(self.teacher, 12)).sum().backward()
        expected = torch.softmax(self.student, -1) - torch.softmax(self.teacher, -1)
        torch.testing.assert_close(student.grad, expected, atol=1e-5, rtol=1e-5)

    def test_labels_ignore_tf32_and_autocast(self):
        # The teacher's matmul runs in f32 even inside a bf16 autocast region (CPU autocast stands in for CUDA's).
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = teacher_for(self.teacher, 0).logp
        torch.testing.assert_close(inside, torch.log_softmax(self.teacher, -1), atol=1e-6, rtol=0)


class ChainRowTests(unittest.TestCase):
    def test_slots_after_a_sampled_token_have_no_rows(self):
        inside = torch.tensor([[False, True, True, True, True]])
        greedy = torch.tensor([[True, True, False, True, True]])  # the token of slot 2 was sampled
        kd, ce = distill.chain_rows(greedy, inside)
        self.assertEqual(kd.tolist(), [[False, True, True, False, False]])  # slot 2's label is still exact
        self.assertEqual(ce.tolist(), [[False, True, False, False, False]])  # but not a greedy hard label

    def test_block_layout_masks_slots_on_sampled_chains(self):
        ids = torch.arange(20, 40)[None]
        greedy = torch.zeros(1, 20, dtype=torch.bool)
        greedy[0, 8:] = True  # response from 4; tokens 4..7 were sampled, greedy from 8 on
        layout = dfl.block_layout(ids, torch.tensor([20]), torch.tensor([[5, 7, 9]]), 4, 99, greedy)
        # Anchor 5: slot 1 (token 6, sampled) gets its exact label; slot 2 follows sampled token 6: none.
        self.assertEqual(layout.kd_rows[0, 0].tolist(), [False, True, False, False])
        # Anchor 7: slot 1 predicts token 8 (greedy), slots 2, 3 follow greedy tokens.
        self.assertEqual(layout.kd_rows[0, 1].tolist(), [False, True, True, True])
        self.assertEqual(layout.ce_rows[0, 1].tolist(), [False, True, True, True])
        self.assertEqual(layout.ce_rows[0, 0].tolist(), [False, False, False, False])
        self.assertEqual(layout.teacher_pos[0, 1].tolist(), [6, 7, 8, 9])

    def test_every_trained_row_reads_a_computed_teacher_position(self):
        gen = torch.Generator().manual_seed(2)
        loss_mask = torch.zeros(3, 30, dtype=torch.bool)
        lengths = torch.tensor([30, 22, 17])
        for row, (p, n) in enumerate(((5, 30), (9, 22), (3, 17))):
            loss_mask[row, p:n] = True
        anchors = dfl.sample_anchors(loss_mask, lengths, 12, gen)
        layout = dfl.block_layout(torch.randint(6, 128, (3, 30), generator=gen), lengths, anchors, 8, 5, loss_mask)
        needed = distill.label_positions(loss_mask)
        rows = torch.arange(3)[:, None, None].expand_as(layout.kd_rows)[layout.kd_rows]
        self.assertTrue(bool(needed[rows, layout.teacher_pos[layout.kd_rows]].all()))

    def test_mtp_chains_need_greedy_intermediate_tokens(self):
        greedy = torch.tensor([[False, False, True, False, True, True, True, True]])
        self.assertTrue(bool(mtp_mod.chain_greedy(greedy, 1).all()))
        # Depth 2 at entry j has one intermediate token, x_{j+1}.
        self.assertEqual(mtp_mod.chain_greedy(greedy, 2)[0].tolist(), [False, True, False, True, True, True, True,
                                                                        True])
        # Depth 3 at entry j: x_j and x_{j+1}.
        self.assertEqual(mtp_mod.chain_greedy(greedy, 3)[0, 3:6].tolist(), [False, True, True])


class SampledTextTests(unittest.TestCase):
    """Slots >= 2 never learn from sampled text: changing the teacher where only such rows would look changes
    nothing, while the same change on a greedy chain does."""

    def loss_with(self, greedy: torch.Tensor, poke: int | None) -> float:
        model = tiny_drafter()
        gen = torch.Generator().manual_seed(7)
        s, block = 16, 4
        ids = torch.randint(6, 128, (1, s), generator=gen)
        final = torch.randn(1, s, TINY.hidden_size, generator=gen)
        if poke is not None:
            final[0, poke] += 5.0
        embed = torch.randn(128, TINY.hidden_size, generator=gen)
        anchors = torch.tensor([[4]])
        layout = dfl.block_layout(ids, torch.tensor([s]), anchors, block, 5, greedy)
        taps = torch.randn(1, s, 2 * TINY.hidden_size, generator=gen)
        mask = dfl.attention_mask(anchors, torch.tensor([s]), s, block)
        hidden = dfl.packed_forward(model, taps, embed[layout.ids], layout.pos, mask, block)
        teacher = distill.Teacher(final, embed, torch.ones(1, s, dtype=torch.bool), 8)
        out = dfl.drafter_losses(model, hidden, layout, embed, 4.0, 4, distill.LossConfig(), teacher)
        return float(out["token_loss"].detach())

    def test_teacher_behind_a_sampled_token_is_never_read(self):
        sampled = torch.ones(1, 16, dtype=torch.bool)
        sampled[0, 5] = False  # the token of slot 1 was sampled: slots 2, 3 (teacher positions 6, 7) are out
        base = self.loss_with(sampled, None)
        self.assertEqual(self.loss_with(sampled, 6), base)
        self.assertEqual(self.loss_with(sampled, 7), base)
        self.assertNotEqual(self.loss_with(sampled, 4), base)  # slot 1's exact label is used
        greedy = torch.ones(1, 16, dtype=torch.bool)
        self.assertNotEqual(self.loss_with(greedy, 6), self.loss_with(greedy, None))


if __name__ == "__main__":
    unittest.main()
