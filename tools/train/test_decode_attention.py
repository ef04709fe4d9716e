"""The decode attention kernel against its reference, on the CPU through Triton's interpreter."""

import os
import unittest
import unittest.mock

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is first built (decode_attention builds lazily)

import torch  # noqa: E402

import decode_attention as da  # noqa: E402


@unittest.skipUnless(da.available(), "triton is not installed")
class DecodeAttentionTest(unittest.TestCase):
    def check(self, rows: int, heads: int, kv_heads: int, slots: int, lengths: list[int], strided: bool):
        g = torch.Generator().manual_seed(rows * 7 + slots)
        hd = 64
        q = torch.randn(rows, 1, heads, hd, generator=g).transpose(1, 2)[:, :, 0]  # strided as the pool's q
        shape = (rows + 3 if strided else rows, kv_heads, slots, hd)
        k_all, v_all = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
        k, v = (k_all[:rows], v_all[:rows]) if strided else (k_all, v_all)
        length = torch.tensor(lengths)
        want = da.reference(q, k, v, length, hd**-0.5)
        got = da.decode_attention(q, k, v, length, hd**-0.5)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

    def test_rows_of_every_length_read_their_own_keys_only(self):
        # Lengths of one key, a partial tile, exactly a tile and several tiles, in a cache longer than all of them.
        self.check(rows=5, heads=9, kv_heads=3, slots=200, lengths=[1, 17, 64, 130, 199], strided=False)

    def test_a_compacted_cache_view_and_ungrouped_heads(self):
        self.check(rows=3, heads=4, kv_heads=4, slots=70, lengths=[70, 2, 65], strided=True)

    def test_keys_past_a_rows_length_do_not_count(self):
        g = torch.Generator().manual_seed(3)
        q = torch.randn(2, 9, 64, generator=g)
        k, v = torch.randn(2, 3, 96, 64, generator=g), torch.randn(2, 3, 96, 64, generator=g)
        lengths = torch.tensor([40, 96])
        first = da.decode_attention(q, k, v, lengths, 0.125)
        k[0, :, 40:], v[0, :, 40:] = 1e4, -1e4
        torch.testing.assert_close(da.decode_attention(q, k, v, lengths, 0.125)[0], first[0])

    def test_shapes_the_kernel_cannot_take_are_refused(self):
        q, k = torch.randn(1, 9, 64), torch.randn(1, 2, 8, 64)
        with self.assertRaises(ValueError):
            da.decode_attention(q, k, k.clone(), torch.tensor([8]), 1.0)


@unittest.skipUnless(da.available(), "triton is not installed")
class PoolWithDecodeAttentionTest(unittest.TestCase):
    def test_the_pool_checks_the_kernel_then_decodes_with_it_to_the_same_tokens(self):
        from decode_pool import DecodePool, Job
        from test_generate import random_prompts
        from test_train import tiny_target

        model = tiny_target(1)
        jobs = [Job(p) for p in random_prompts(5, seed=2)]
        plain = DecodePool(model, rows=3, max_prompt=16, max_new=8, check_every=2).run(jobs)
        pool = DecodePool(model, rows=3, max_prompt=16, max_new=8, check_every=2)
        pool.fast_attention = None  # what CUDA with Triton starts from: check on the first step
        results = pool.run(jobs)
        self.assertIs(pool.fast_attention, True)
        self.assertEqual(pool._key_length(), pool.slots)
        self.assertEqual([r.tokens for r in results], [r.tokens for r in plain])

    def test_a_kernel_that_disagrees_leaves_sdpa(self):
        from decode_pool import DecodePool, Job
        from test_generate import random_prompts
        from test_train import tiny_target

        model = tiny_target(1)
        pool = DecodePool(model, rows=2, max_prompt=16, max_new=4, check_every=2)
        pool.fast_attention = None
        wrong = lambda q, k, v, lengths, scale: torch.zeros(q.shape, dtype=q.dtype)  # noqa: E731
        with unittest.mock.patch.object(da, "decode_attention", wrong), self.assertWarns(UserWarning):
            pool.run([Job(p) for p in random_prompts(2, seed=5)])
        self.assertIs(pool.fast_attention, False)


if __name__ == "__main__":
    unittest.main()
