"""Continuous-batching generation with a static KV cache: the data generator's engine.

A pool of R rows shares one preallocated cache [layers, R, kv heads, T, head dim] (bf16 on GPU). Every row holds
one request: its prompt sits at cache slots 0..p-1 (no padding, positions = slots), and each decode step feeds
every row's last token at its own slot. When a row ends (EOS, or max_new tokens), it is refilled with the next
request at the next check (every `check_every` steps, the only host-device synchronisation of the loop), so
the GPU keeps working on full batches while requests of very different lengths come and go. Prompts of a refill
are prefilled together (right-padded, causal) and copied into their rows. The attention of a decode step reads
each row's own slots (decode_attention.py, on CUDA with Triton, checked against SDPA on the first step); with
SDPA it reads slots 0..max(row length), rounded up to a multiple of KEY_BUCKET (so step shapes repeat), and masks
each row's slots past its own length. Callers sort requests by prompt length so the rows of a pool stay alike.

A request may sample its first `sampled` response tokens at a temperature and continue greedily (a sampled
prefix varies the context; the greedy rest is a chain that greedy verification would accept). The LM head runs
in f32, so the greedy choice is not made on bf16 logits.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import decode_attention as fast_attention
from step_profile import StepProfile
from target import KvCache, LlamaTarget, rope_cos_sin

# Every SDPA backend but cuDNN, whose plans are built per key length: a step's key length changes as rows grow.
# Flash takes no mask, so the decode step's masked attention runs on the memory-efficient kernel (math as the
# fallback); the unmasked causal prefill keeps flash.
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
KEY_BUCKET = 128  # decode key lengths are rounded up to a multiple of this, so a step's shapes repeat
# The first decode step checks the Triton attention against SDPA's on one layer: outputs within this share of the
# largest output (bf16 rounding of the two orders of summation) or SDPA stays.
FAST_ATTENTION_TOLERANCE = 2e-2
COMPACT_ROWS = 32  # rows a compaction moves at once: its temporary is this many rows of K or V (0.85 GB at 2,313 slots)


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    sampled: int = 0  # leading response tokens sampled at `temperature`; the rest is greedy
    temperature: float = 0.7


@dataclass
class Finished:
    tokens: list[int]  # new tokens, ending with EOS when one came
    ended: bool  # ended with EOS (not cut at max_new)


class DecodePool:
    def __init__(self, model: LlamaTarget, rows: int, max_prompt: int, max_new: int, seed: int = 0,
                 check_every: int = 8, prefill_tokens: int = 1 << 16, profile_steps: int = 0,
                 cuda_graphs: bool = False, triton_attention: bool = False):
        self.model, self.cfg = model, model.cfg
        self.profile_steps = profile_steps  # decode steps to profile once the pool is warm (0: none)
        self.device = model.embed_tokens.weight.device
        self.max_new, self.check_every, self.prefill_tokens = max_new, check_every, prefill_tokens
        self.slots = max_prompt + max_new + check_every + 1  # a finished row runs on for up to check_every steps
        dtype = model.embed_tokens.weight.dtype
        self.cache = KvCache(len(model.layers), rows, self.cfg.num_kv_heads, self.slots, self.cfg.head_dim, dtype,
                             self.device)
        self.head = model.embed_tokens.weight.float()  # f32 LM head (tied embedding)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # The decode attention: Triton's, reading each row's own keys (None: not yet checked against SDPA on this
        # device), or SDPA's masked kernel (False).
        on_cuda = self.device.type == "cuda"
        self.fast_attention = None if triton_attention and on_cuda and fast_attention.available() else False
        graphed = cuda_graphs and on_cuda
        self.decode = DecodeGraphs(self._decode) if graphed else self._decode  # the decode step, maybe replayed
        self._reset_rows(rows)

    def _reset_rows(self, rows: int) -> None:
        dev = self.device
        self.rows = rows
        self.job_of_row = np.full(rows, -1, dtype=np.int64)
        self.n_new = np.zeros(rows, dtype=np.int64)  # tokens generated so far (host mirror, no sync needed)
        self.length = np.zeros(rows, dtype=np.int64)  # the slot of the row's last token
        self.active = np.zeros(rows, dtype=bool)
        self.prefix = np.zeros(rows, dtype=np.int64)  # the row's job's sampled-prefix length
        self.temperature = np.zeros(rows, dtype=np.float32)
        self.all_rows = torch.arange(rows, device=dev)
        # The cache entry of (row, kv head) at slot 0, in the cache's [layers, R*kv heads*slots, hd] view.
        heads = self.cfg.num_kv_heads
        self.row_head_entry = torch.arange(rows * heads, device=dev).view(rows, heads) * self.slots
        if isinstance(self.decode, DecodeGraphs):
            self.decode.reset()
        self.prefix_dev = torch.zeros(rows, dtype=torch.long, device=dev)
        self.temperature_dev = torch.ones(rows, dtype=torch.float32, device=dev)
        self.cur = torch.zeros(rows, dtype=torch.long, device=dev)
        self.pos = torch.zeros(rows, dtype=torch.long, device=dev)
        self.count = torch.zeros(rows, dtype=torch.long, device=dev)
        self.out = torch.zeros(rows, self.max_new + self.check_every, dtype=torch.long, device=dev)
        self.eos = torch.zeros(rows, dtype=torch.bool, device=dev)

    # ------------------------------------------------------------------------------------------- forward passes

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.norm(hidden).float() @ self.head.t()

    @torch.no_grad()
    @sdpa_kernel(ATTENTION_BACKENDS)
    def _prefill(self, rows: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Runs the prompts into their rows' cache slots; returns each prompt's last logits [n, V] (f32)."""
        n, p = len(prompts), max(len(x) for x in prompts)
        ids = torch.full((n, p), self.cfg.eos_id, dtype=torch.long)
        for i, x in enumerate(prompts):
            ids[i, : len(x)] = torch.tensor(x)
        ids = ids.to(self.device)
        lengths = torch.tensor([len(x) for x in prompts], device=self.device)
        row_index = torch.tensor(rows, device=self.device)
        x = self.model.embed_tokens(ids)
        positions = torch.arange(p, device=self.device).expand(n, p)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        for i, layer in enumerate(self.model.layers):
            q, k, v = layer.qkv(layer.input_layernorm(x), cos, sin)
            # Right padding: every real position attends causally to real positions only.
            self.cache.k[i][row_index, :, :p] = k
            self.cache.v[i][row_index, :, :p] = v
            x = layer.finish(x, layer.attend(q, k, v, is_causal=True))
        return self._logits(x[torch.arange(n, device=self.device), lengths - 1])

    @torch.no_grad()
    @sdpa_kernel(ATTENTION_BACKENDS)
    def _decode(self, cur: torch.Tensor, pos: torch.Tensor, end: int) -> torch.Tensor:
        """One step for every row: feeds cur at pos and attends to slots 0..end-1 (end: a key-length bucket, or
        every slot); returns next-token logits [R, V] (f32)."""
        x = self.model.embed_tokens(cur[:, None])
        cos, sin = rope_cos_sin(pos[:, None], self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        fast = self.fast_attention
        mask = None if fast else decode_mask(pos, end, x.dtype)
        lengths = pos + 1
        # Each (row, kv head)'s new entry goes to one row of the cache seen as [layers, R*kv heads*slots, hd]:
        # one index_copy_ per tensor and layer.
        entry = (self.row_head_entry + pos[:, None]).view(-1)
        k_entries, v_entries = (c.view(c.shape[0], -1, c.shape[-1]) for c in (self.cache.k, self.cache.v))
        k_read, v_read = self.cache.k[:, :, :, :end], self.cache.v[:, :, :, :end]
        for i, layer in enumerate(self.model.layers):
            q, k, v = layer.qkv(layer.input_layernorm(x), cos, sin)
            k_entries[i].index_copy_(0, entry, k.reshape(entry.shape[0], -1))
            v_entries[i].index_copy_(0, entry, v.reshape(entry.shape[0], -1))
            if fast:
                attended = self._fast_attend(q, i, lengths)
            else:
                attended = layer.attend(q, k_read[i], v_read[i], mask=mask)
                if fast is None:
                    fast = self.fast_attention = self._fast_attention_agrees(q, i, lengths, attended)
            x = layer.finish(x, attended)
        return self._logits(x[:, -1])

    def _fast_attend(self, q: torch.Tensor, layer: int, lengths: torch.Tensor) -> torch.Tensor:
        """q [R, nh, 1, hd] over the cache's layer, each row's keys 0..length-1 -> [R, 1, nh * hd]."""
        r, nh, _, hd = q.shape
        out = fast_attention.decode_attention(q[:, :, 0], self.cache.k[layer], self.cache.v[layer], lengths,
                                              hd**-0.5)
        return out.view(r, 1, nh * hd)

    def _fast_attention_agrees(self, q: torch.Tensor, layer: int, lengths: torch.Tensor, want: torch.Tensor) -> bool:
        """Whether the Triton attention gives SDPA's output `want` (within bf16 rounding) on this step's layer; it
        decodes from then on if so, else SDPA stays (with a warning)."""
        try:
            got = self._fast_attend(q, layer, lengths)
        except Exception as err:  # a kernel that does not build here (driver, Triton version) leaves SDPA
            warnings.warn(f"decode pool: the Triton decode attention failed ({err}); SDPA decodes")
            return False
        worst = (got.float() - want.float()).abs().max().item()
        scale = max(1.0, want.float().abs().max().item())
        if not worst <= FAST_ATTENTION_TOLERANCE * scale:  # NaN fails too
            warnings.warn(f"decode pool: the Triton decode attention differs from SDPA by {worst:.3g}; SDPA decodes")
            return False
        return True

    # ------------------------------------------------------------------------------------------- token choice

    def _choose(self, logits: torch.Tensor, rows: np.ndarray, row_index: torch.Tensor) -> torch.Tensor:
        """Greedy tokens for `rows`, except rows still inside their sampled prefix: those sample at their
        temperature (plain temperature sampling, no top-k / top-p). The choice happens on the device (Gumbel-max
        over all rows, kept where a row samples), so a step never waits for the device; the host only checks its
        own mirror to skip the sampling when no row needs it."""
        tokens = logits.argmax(-1)
        if not bool((self.active[rows] & (self.n_new[rows] < self.prefix[rows])).any()):
            return tokens
        uniform = torch.rand(logits.shape, generator=self.generator, device=self.device).clamp_(min=1e-30)
        scaled = logits / self.temperature_dev[row_index][:, None]
        sampled = (scaled - torch.log(-torch.log(uniform))).argmax(-1)
        return torch.where(self.count[row_index] < self.prefix_dev[row_index], sampled, tokens)

    # ------------------------------------------------------------------------------------------- bookkeeping

    def _start(self, free: list[int], jobs: list[Job], start: int) -> int:
        """Prefills jobs[start:] into the free rows (in sub-batches of <= prefill_tokens); returns jobs taken."""
        taken = 0
        while taken < len(free) and start + taken < len(jobs):
            group = [start + taken]
            longest = len(jobs[group[0]].prompt)
            while taken + len(group) < len(free) and group[-1] + 1 < len(jobs):
                longest = max(longest, len(jobs[group[-1] + 1].prompt))
                if (len(group) + 1) * longest > self.prefill_tokens:
                    break
                group.append(group[-1] + 1)
            rows = np.array(free[taken: taken + len(group)])
            logits = self._prefill(rows.tolist(), [jobs[j].prompt for j in group])
            self.job_of_row[rows] = group
            self.active[rows] = True
            self.n_new[rows] = 0
            self.prefix[rows] = [jobs[j].sampled for j in group]
            self.temperature[rows] = [jobs[j].temperature for j in group]
            self.length[rows] = [len(jobs[j].prompt) for j in group]
            row_index = torch.from_numpy(rows).to(self.device)
            self.count[row_index] = 0
            self.eos[row_index] = False
            self.pos[row_index] = torch.from_numpy(self.length[rows]).to(self.device)
            self.prefix_dev[row_index] = torch.from_numpy(self.prefix[rows]).to(self.device)
            # Greedy jobs never sample; 1.0 keeps their (unused) scaled logits finite.
            temps = np.where(self.prefix[rows] > 0, self.temperature[rows], 1.0).astype(np.float32)
            self.temperature_dev[row_index] = torch.from_numpy(temps).to(self.device)
            self._record(rows, row_index, self._choose(logits, rows, row_index))
            taken += len(group)
        return taken

    def _record(self, rows: np.ndarray, row_index: torch.Tensor, tokens: torch.Tensor) -> None:
        """Stores the rows' new tokens and makes them the next input."""
        self.out[row_index, self.count[row_index].clamp_max(self.out.shape[1] - 1)] = tokens
        self.count[row_index] += 1
        self.cur[row_index] = tokens
        self.eos[row_index] |= tokens == self.cfg.eos_id
        self.n_new[rows] += 1

    def _collect(self, results: list[Finished | None]) -> None:
        """Moves finished rows' tokens to `results` and frees the rows (one sync)."""
        eos = self.eos.cpu().numpy()
        done = np.nonzero(self.active & (eos | (self.n_new >= self.max_new)))[0]
        if len(done) == 0:
            return
        tokens = self.out[torch.tensor(done, device=self.device)].cpu().numpy()
        for row, toks in zip(done, tokens, strict=True):
            seq = toks[: min(self.n_new[row], self.max_new)].tolist()
            ended = self.cfg.eos_id in seq
            if ended:
                seq = seq[: seq.index(self.cfg.eos_id) + 1]
            results[self.job_of_row[row]] = Finished(seq, ended)
        self.finished += len(done)
        self.active[done] = False
        self.job_of_row[done] = -1

    def _compact(self) -> None:
        """Keeps only the active rows (the tail of a run, when no job is left to refill freed rows). The cache's
        kept rows move to its front in place, COMPACT_ROWS at a time, so no second cache is ever allocated: kept
        row j comes from row keep[j] >= j, so a chunk's sources lie at or past its own rows (gathered before they
        are written) and past every earlier chunk's."""
        keep = np.nonzero(self.active)[0]
        index = torch.tensor(keep, device=self.device)
        for first in range(0, len(keep), COMPACT_ROWS):
            rows = index[first:first + COMPACT_ROWS]
            for cache in (self.cache.k, self.cache.v):
                cache[:, first:first + len(rows)] = cache[:, rows]
        self.cache.k, self.cache.v = self.cache.k[:, :len(keep)], self.cache.v[:, :len(keep)]
        state = (self.job_of_row[keep], self.n_new[keep], self.length[keep], self.prefix[keep],
                 self.temperature[keep], self.cur[index], self.pos[index], self.count[index], self.out[index],
                 self.eos[index], self.prefix_dev[index], self.temperature_dev[index])
        self._reset_rows(len(keep))
        (self.job_of_row, self.n_new, self.length, self.prefix, self.temperature, self.cur, self.pos, self.count,
         self.out, self.eos, self.prefix_dev, self.temperature_dev) = state
        self.active[:] = True

    # ------------------------------------------------------------------------------------------- the loop

    def run(self, jobs: list[Job], deadline: float = float("inf"), progress=None) -> list[Finished | None]:
        """Generates every job (in order of start) until done or, after the deadline, until the running rows end;
        jobs never started are None. progress(done, started, new_tokens) is called at every check."""
        results: list[Finished | None] = [None] * len(jobs)
        self.finished = 0
        next_job = self._start(list(range(self.rows)), jobs, 0)
        steps = 0
        profile = StepProfile(self.profile_steps, self.device, warm_steps=64, what="decode_pool",
                              unit="decode steps")
        while self.active.any():
            profile.before(steps)
            self._step()
            profile.after()
            steps += 1
            if steps % self.check_every:
                continue
            self._collect(results)
            free = [int(r) for r in np.nonzero(~self.active)[0]]
            if next_job < len(jobs) and time.time() < deadline and free and (
                    len(free) * 8 >= self.rows or not self.active.any()):
                next_job += self._start(free, jobs, next_job)
            elif (next_job >= len(jobs) or time.time() >= deadline) and self.active.sum() * 2 <= self.rows:
                if self.active.any():
                    self._compact()
            if progress is not None:
                progress(self.finished, next_job, int(self.n_new[self.active].sum()))
        profile.end()  # the pool may run out of work inside the profile
        self._collect(results)
        return results

    def _key_length(self) -> int:
        """Slots the step attends to: past every active row's new slot, rounded up to a bucket."""
        if self.fast_attention is not False:
            # Each row reads its own keys: one step shape (and one graph) for every length. The first step, which
            # checks the kernel, attends with SDPA over every slot, so its graph is that shape too.
            return self.slots
        end = int(self.length[self.active].max()) + 1
        return min(-(-end // KEY_BUCKET) * KEY_BUCKET, self.slots)

    def _step(self) -> None:
        logits = self.decode(self.cur, self.pos, self._key_length())
        rows = np.arange(self.rows)
        self._record(rows, self.all_rows, self._choose(logits, rows, self.all_rows))
        self.pos = (self.pos + 1).clamp_max(self.slots - 1)
        self.length = np.minimum(self.length + 1, self.slots - 1)


class DecodeGraphs:
    """The decode step as CUDA graphs, one per step shape (with SDPA, per key-length bucket of the pool's current
    rows; with the Triton attention, one), captured on first use.

    A step is host-bound in eager mode (~1,300 kernel launches for 30 layers); a replay launches them all at once.
    The inputs are copied into static tensors before a replay; the logits come back in the graph's own output
    tensor, valid until the next replay (the pool consumes them at once). The graphs share one memory pool (they
    never run concurrently); each keeps its [R, V] f32 logits (200 MB at 1,024 rows). A failed capture warns and
    leaves the pool decoding eagerly.
    """

    def __init__(self, decode):
        self.eager = decode  # (cur, pos, end) -> logits; graphed, it must only read its inputs and the pool's state
        self.failed = False
        self.reset()

    def reset(self) -> None:
        """Drops the graphs: they hold the addresses of the pool's cache and row tensors, which a compaction
        replaces. A failed capture stays failed."""
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.cur = self.pos = self.memory = None

    def __call__(self, cur: torch.Tensor, pos: torch.Tensor, end: int) -> torch.Tensor:
        if self.failed:
            return self.eager(cur, pos, end)
        if self.cur is None:
            self.cur, self.pos = torch.empty_like(cur), torch.empty_like(pos)
        self.cur.copy_(cur)
        self.pos.copy_(pos)
        if end not in self.graphs:
            try:
                self.graphs[end] = self._capture(end)
            except RuntimeError as err:
                warnings.warn(f"decode pool: CUDA graph capture failed, decoding eagerly: {err}")
                self.failed, self.graphs = True, {}
                return self.eager(cur, pos, end)
        graph, logits = self.graphs[end]
        graph.replay()
        return logits

    def _capture(self, end: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warms up on a side stream (as capture requires), then captures. Both run the real step: it is
        idempotent (the same K/V land in the same cache entries), so the replay that follows gives its logits."""
        if self.memory is None:
            self.memory = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.eager(self.cur, self.pos, end)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory):
            logits = self.eager(self.cur, self.pos, end)
        return graph, logits


def decode_mask(pos: torch.Tensor, end: int, dtype: torch.dtype) -> torch.Tensor:
    """[R, 1, 1, end] additive mask: 0 at slots <= the row's position, -inf after (exp(-inf) is 0, so slots past a
    row's end, stale or not, contribute nothing). Additive rather than boolean: SDPA would convert a boolean mask
    in every layer."""
    keys = torch.arange(end, device=pos.device)
    mask = torch.zeros(pos.shape[0], end, dtype=dtype, device=pos.device)
    return mask.masked_fill_(keys[None, :] > pos[:, None], float("-inf"))[:, None, None, :]
