//! The gated delta rule of one value head, in its two exact forms (HF `torch_recurrent_gated_delta_rule` and
//! `torch_chunk_gated_delta_rule`).
//!
//! State `S` is `[k_dim, v_dim]`. Per token, with `q` and `k` L2-normalised (`q` also scaled by `1/√k_dim`),
//! decay `e^g` and write strength `β`:
//!
//! ```text
//! S ← e^g · S;   S ← S + k ⊗ β (v − Sᵀk);   o = Sᵀ q
//! ```
//!
//! The recurrent form runs that token by token (decode, verify, rollback replay). The chunked form (prefill)
//! turns each chunk of up to [`DELTA_RULE_CHUNK`] tokens into small dense products (the WY form: a triangular
//! solve for the in-chunk corrections, then one state update per chunk). Chunks are cut at absolute positions
//! that are multiples of [`DELTA_RULE_CHUNK`], as HF cuts a whole prompt, so a prompt prefilled in pieces whose
//! cuts fall on chunk boundaries runs the same chunks as one whole prefill.

/// Tokens per chunk of the chunked form (HF's `chunk_size`).
pub const DELTA_RULE_CHUNK: usize = 64;

/// One value head's inputs over a run of rows.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HeadRun<'a> {
    pub q: &'a [f32],    // [n, dk], normalised and scaled
    pub k: &'a [f32],    // [n, dk], normalised
    pub v: &'a [f32],    // [n, dv]
    pub g: &'a [f32],    // [n], log decay (≤ 0)
    pub beta: &'a [f32], // [n]
}

impl HeadRun<'_> {
    fn len(&self) -> usize {
        self.g.len()
    }
}

/// One token's state update: `S ← e^g S`, then `S ← S + k ⊗ β (v − Sᵀk)`.
///
/// `s`: `[dk, dv]`, updated; `k`: `[dk]`; `v`: `[dv]`; `mem`: `[dv]` of scratch. This is the only place the
/// recurrent state is stepped, for decode, verify and rollback replay alike, so a replay reproduces the
/// verify's states bit for bit.
pub fn delta_rule_step(s: &mut [f32], k: &[f32], v: &[f32], g: f32, beta: f32, mem: &mut [f32]) {
    let dv = v.len();
    let decay = g.exp();
    s.iter_mut().for_each(|x| *x *= decay);
    mem.fill(0.0);
    for (row, &ki) in s.chunks_exact(dv).zip(k) {
        for (m, &sij) in mem.iter_mut().zip(row) {
            *m += sij * ki;
        }
    }
    for (m, &vj) in mem.iter_mut().zip(v) {
        *m = (vj - *m) * beta;
    }
    for (row, &ki) in s.chunks_exact_mut(dv).zip(k) {
        for (sij, &dj) in row.iter_mut().zip(mem.iter()) {
            *sij += ki * dj;
        }
    }
}

/// `out = Sᵀ q`.
fn read_state(s: &[f32], q: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    for (row, &qi) in s.chunks_exact(out.len()).zip(q) {
        for (o, &sij) in out.iter_mut().zip(row) {
            *o += sij * qi;
        }
    }
}

/// Token by token. `s`: `[dk, dv]`, updated; `out`: `[n, dv]`.
pub(crate) fn recurrent(s: &mut [f32], run: HeadRun, out: &mut [f32]) {
    let n = run.len();
    let dk = run.q.len() / n.max(1);
    let dv = run.v.len() / n.max(1);
    let mut mem = vec![0f32; dv];
    for t in 0..n {
        let (k, v) = (&run.k[t * dk..(t + 1) * dk], &run.v[t * dv..(t + 1) * dv]);
        delta_rule_step(s, k, v, run.g[t], run.beta[t], &mut mem);
        read_state(s, &run.q[t * dk..(t + 1) * dk], &mut out[t * dv..(t + 1) * dv]);
    }
}

/// Chunk by chunk, the first row at absolute position `first_pos`. `s`: `[dk, dv]`, updated; `out`: `[n, dv]`.
pub(crate) fn chunked(s: &mut [f32], run: HeadRun, first_pos: usize, out: &mut [f32]) {
    let n = run.len();
    let dk = run.q.len() / n.max(1);
    let dv = run.v.len() / n.max(1);
    let mut start = 0;
    while start < n {
        let len = (DELTA_RULE_CHUNK - (first_pos + start) % DELTA_RULE_CHUNK).min(n - start);
        let part = HeadRun {
            q: &run.q[start * dk..(start + len) * dk],
            k: &run.k[start * dk..(start + len) * dk],
            v: &run.v[start * dv..(start + len) * dv],
            g: &run.g[start..start + len],
            beta: &run.beta[start..start + len],
        };
        chunk(s, part, dk, dv, &mut out[start * dv..(start + len) * dv]);
        start += len;
    }
}

/// One chunk of `L` rows in the WY form (HF's per-chunk steps, the padding rows left out).
fn chunk(s: &mut [f32], run: HeadRun, dk: usize, dv: usize, out: &mut [f32]) {
    let l = run.len();
    let mut cum = vec![0f32; l]; // G: in-chunk cumulative log decay
    let mut acc = 0f32;
    for (c, &g) in cum.iter_mut().zip(run.g) {
        acc += g;
        *c = acc;
    }
    let kb: Vec<f32> = scale_rows(run.k, run.beta, dk);
    let vb: Vec<f32> = scale_rows(run.v, run.beta, dv);
    let t = wy_transform(&kb, run.k, &cum, dk);
    // U = T · (β v); W = T · (β k e^G)
    let decayed: Vec<f32> = kb.iter().enumerate().map(|(x, &v)| v * cum[x / dk].exp()).collect();
    let u = lower_times(&t, &vb, l, dv);
    let w = lower_times(&t, &decayed, l, dk);
    // v_new = U − W · S
    let mut v_new = u;
    for i in 0..l {
        let row = &mut v_new[i * dv..(i + 1) * dv];
        for (a, &wia) in w[i * dk..(i + 1) * dk].iter().enumerate() {
            for (x, &sa) in row.iter_mut().zip(&s[a * dv..(a + 1) * dv]) {
                *x -= wia * sa;
            }
        }
    }
    chunk_output(s, run, &cum, &v_new, dk, dv, out);
    // S ← e^{G_last} S + Σ_i (k_i e^{G_last − G_i}) ⊗ v_new_i
    let last = cum[l - 1];
    let total = last.exp();
    s.iter_mut().for_each(|x| *x *= total);
    for i in 0..l {
        let f = (last - cum[i]).exp();
        for (a, &ka) in run.k[i * dk..(i + 1) * dk].iter().enumerate() {
            let kf = ka * f;
            for (x, &vn) in s[a * dv..(a + 1) * dv].iter_mut().zip(&v_new[i * dv..(i + 1) * dv]) {
                *x += kf * vn;
            }
        }
    }
}

/// `o_i = (q_i e^{G_i})ᵀ S + Σ_{j ≤ i} (q_i · k_j) e^{G_i − G_j} v_new_j` with the state before the chunk.
fn chunk_output(s: &[f32], run: HeadRun, cum: &[f32], v_new: &[f32], dk: usize, dv: usize, out: &mut [f32]) {
    let l = cum.len();
    for i in 0..l {
        let qi = &run.q[i * dk..(i + 1) * dk];
        let o = &mut out[i * dv..(i + 1) * dv];
        let qd: Vec<f32> = qi.iter().map(|&x| x * cum[i].exp()).collect();
        read_state(s, &qd, o);
        for j in 0..=i {
            let p = dot(qi, &run.k[j * dk..(j + 1) * dk]) * (cum[i] - cum[j]).exp();
            for (x, &vn) in o.iter_mut().zip(&v_new[j * dv..(j + 1) * dv]) {
                *x += p * vn;
            }
        }
    }
}

/// `T = (I + A)⁻¹`-style lower-triangular matrix of the chunk (HF's forward substitution, then `+ I`), where
/// `A_ij = −(β_i k_i · k_j) e^{G_i − G_j}` for `j < i`. Returns `[L, L]`, row-major.
fn wy_transform(kb: &[f32], k: &[f32], cum: &[f32], dk: usize) -> Vec<f32> {
    let l = cum.len();
    let mut a = vec![0f32; l * l];
    for i in 0..l {
        for j in 0..i {
            a[i * l + j] = -dot(&kb[i * dk..(i + 1) * dk], &k[j * dk..(j + 1) * dk]) * (cum[i] - cum[j]).exp();
        }
    }
    let mut old = vec![0f32; l];
    for i in 1..l {
        old[..i].copy_from_slice(&a[i * l..i * l + i]);
        for j in 0..i {
            let mut sum = 0f32;
            for m in j + 1..i {
                sum += old[m] * a[m * l + j];
            }
            a[i * l + j] = old[j] + sum;
        }
    }
    for i in 0..l {
        a[i * l + i] = 1.0;
    }
    a
}

/// `T · x` for lower-triangular `T` `[L, L]` and `x` `[L, w]`.
fn lower_times(t: &[f32], x: &[f32], l: usize, w: usize) -> Vec<f32> {
    let mut y = vec![0f32; l * w];
    for i in 0..l {
        let row = &mut y[i * w..(i + 1) * w];
        for j in 0..=i {
            let tij = t[i * l + j];
            for (yv, &xv) in row.iter_mut().zip(&x[j * w..(j + 1) * w]) {
                *yv += tij * xv;
            }
        }
    }
    y
}

/// Row `i` of `x` `[n, w]` times `f[i]`.
fn scale_rows(x: &[f32], f: &[f32], w: usize) -> Vec<f32> {
    x.chunks_exact(w).zip(f).flat_map(|(row, &fi)| row.iter().map(move |&v| v * fi)).collect()
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Inputs {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        g: Vec<f32>,
        beta: Vec<f32>,
    }

    impl Inputs {
        fn new(n: usize, dk: usize, dv: usize, seed: u32) -> Self {
            let mut s = seed.wrapping_mul(2_654_435_761) | 1;
            let mut next = move || {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 20_001) as f32 / 10_000.0 - 1.0
            };
            let mut unit = |len: usize, scale: f32| -> Vec<f32> {
                let mut x: Vec<f32> = (0..len).map(|_| next()).collect();
                for row in x.chunks_exact_mut(dk) {
                    let norm = row.iter().map(|v| v * v).sum::<f32>().sqrt();
                    row.iter_mut().for_each(|v| *v *= scale / norm);
                }
                x
            };
            let q = unit(n * dk, 1.0 / (dk as f32).sqrt());
            let k = unit(n * dk, 1.0);
            let v = (0..n * dv).map(|_| next()).collect();
            let g = (0..n).map(|_| -0.2 * (next() + 1.0) - 0.005).collect();
            let beta = (0..n).map(|_| 0.5 * (next() + 1.0)).collect();
            Inputs { q, k, v, g, beta }
        }

        fn run(&self, rows: std::ops::Range<usize>, dk: usize, dv: usize) -> HeadRun<'_> {
            HeadRun {
                q: &self.q[rows.start * dk..rows.end * dk],
                k: &self.k[rows.start * dk..rows.end * dk],
                v: &self.v[rows.start * dv..rows.end * dv],
                g: &self.g[rows.clone()],
                beta: &self.beta[rows],
            }
        }
    }

    fn close(got: &[f32], want: &[f32], tol: f32, what: &str) {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= tol * w.abs().max(1.0), "{what}[{i}]: {g} vs {w}");
        }
    }

    #[test]
    fn chunked_form_equals_recurrent_form() {
        let (dk, dv) = (8, 6);
        for (n, first_pos) in [(1, 0), (5, 3), (64, 0), (150, 0), (90, 50)] {
            let x = Inputs::new(n, dk, dv, n as u32 + first_pos as u32);
            let init: Vec<f32> = (0..dk * dv).map(|i| (i as f32 * 0.37).sin() * 0.3).collect();
            let (mut s_rec, mut s_chunk) = (init.clone(), init);
            let (mut o_rec, mut o_chunk) = (vec![0f32; n * dv], vec![0f32; n * dv]);
            recurrent(&mut s_rec, x.run(0..n, dk, dv), &mut o_rec);
            chunked(&mut s_chunk, x.run(0..n, dk, dv), first_pos, &mut o_chunk);
            close(&o_chunk, &o_rec, 2e-5, &format!("out n={n} at {first_pos}"));
            close(&s_chunk, &s_rec, 2e-5, &format!("state n={n} at {first_pos}"));
        }
    }

    #[test]
    fn chunk_aligned_pieces_equal_one_whole_run_bit_for_bit() {
        let (dk, dv, n) = (4, 4, 140);
        let x = Inputs::new(n, dk, dv, 9);
        let mut whole = vec![0f32; dk * dv];
        let mut out_whole = vec![0f32; n * dv];
        chunked(&mut whole, x.run(0..n, dk, dv), 0, &mut out_whole);
        let mut pieces = vec![0f32; dk * dv];
        let mut out_pieces = vec![0f32; n * dv];
        for range in [0..64, 64..128, 128..n] {
            let (a, b) = (range.start * dv, range.end * dv);
            chunked(&mut pieces, x.run(range.clone(), dk, dv), range.start, &mut out_pieces[a..b]);
        }
        assert_eq!(whole, pieces);
        assert_eq!(out_whole, out_pieces);
    }

    #[test]
    fn recurrent_steps_compose() {
        // A run of n tokens equals n runs of one token: the per-token update is the whole recurrence.
        let (dk, dv, n) = (4, 3, 7);
        let x = Inputs::new(n, dk, dv, 5);
        let mut s_run = vec![0.1f32; dk * dv];
        let mut s_steps = s_run.clone();
        let mut out = vec![0f32; n * dv];
        recurrent(&mut s_run, x.run(0..n, dk, dv), &mut out);
        let mut mem = vec![0f32; dv];
        for t in 0..n {
            delta_rule_step(
                &mut s_steps,
                &x.k[t * dk..(t + 1) * dk],
                &x.v[t * dv..(t + 1) * dv],
                x.g[t],
                x.beta[t],
                &mut mem,
            );
        }
        assert_eq!(s_run, s_steps);
    }
}
