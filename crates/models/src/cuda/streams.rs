//! Hyper-connection streams in a CUDA step: the connections' weights on the device and the calls a family's step
//! makes around its blocks (the CPU twin is [`crate::streams`]). The streams, the block outputs and the mix weights
//! live in the workspace; a block reads its collapsed input from `residual` and writes its output to `delta`.

use dflash_runtime::cuda::ops::{
    copy_columns, fill_random_f32, streams_broadcast, streams_collapse, streams_expand, streams_head, streams_mean,
    StreamConnection, StreamDims, StreamMix,
};
use dflash_runtime::cuda::{CudaDevice, DeviceBuf};

use super::cache::Workspace;
use super::error::Result;
use crate::streams::{HyperConnection, ModelStreams, StreamHead, StreamTap};

/// One connection's weights on the device.
#[derive(Debug)]
struct DevConnection {
    proj: DeviceBuf<f32>,
    base: DeviceBuf<f32>,
    scale: DeviceBuf<f32>,
}

impl DevConnection {
    fn view(&self) -> StreamConnection<'_> {
        StreamConnection { proj: self.proj.view(), base: self.base.view(), scale: self.scale.view() }
    }
}

/// Which connection of a layer a block enters through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Block {
    Mixer,
    Ffn,
}

/// A tap the drafter reads after a layer: its index among the taps and the captured rows' width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tap {
    pub index: usize,
    pub width: usize,
}

/// Where a block's exit goes on to: layer `.0`'s `.1` block, or the head's collapse (after the last layer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Next {
    Block(usize, Block),
    Head,
}

impl Next {
    /// What follows layer `layer`'s feed-forward block in a model of `layers` layers.
    pub(crate) fn after_layer(layer: usize, layers: usize) -> Self {
        if layer + 1 < layers {
            Next::Block(layer + 1, Block::Mixer)
        } else {
            Next::Head
        }
    }
}

/// A stream target's connections on the device.
#[derive(Debug)]
pub(crate) struct DevStreams {
    pub dims: StreamDims,
    /// Per layer: the token mixer's and the feed-forward's connection.
    layers: Vec<[DevConnection; 2]>,
    head: DevConnection,
    pub tap: StreamTap,
}

impl DevStreams {
    /// Uploads a loaded model's connections (`norm_eps`: the model's `rms_norm_eps`).
    ///
    /// # Errors
    /// Out of device memory.
    pub(crate) fn upload(dev: &CudaDevice, host: &ModelStreams, hidden: usize, norm_eps: f32) -> Result<Self> {
        let up = |hc: &HyperConnection| -> Result<DevConnection> {
            let (proj, base, scale) = hc.parts();
            Ok(DevConnection { proj: dev.upload(proj.as_f32()?)?, base: dev.upload(base)?, scale: dev.upload(scale)? })
        };
        let layers = host.layers.iter().map(|l| Ok([up(&l.attn)?, up(&l.ffn)?])).collect::<Result<Vec<_>>>()?;
        let head: &StreamHead = &host.head;
        let (proj, base, scale) = head.parts();
        let head =
            DevConnection { proj: dev.upload(proj.as_f32()?)?, base: dev.upload(base)?, scale: dev.upload(&[scale])? };
        let c = host.cfg;
        let dims = StreamDims { streams: c.count, hidden, sinkhorn_iters: c.sinkhorn_iters, eps: c.eps, norm_eps };
        Ok(DevStreams { dims, layers, head, tap: host.tap })
    }

    /// Random connections made on the device for a model of `layers` layers (benchmarks of shapes no checkpoint
    /// here has): projections uniform in `±1/√(N·H)`, biases in `±0.5`, scales near 1, so the mix weights are
    /// spread as a trained model's are; taps read the streams' mean.
    ///
    /// # Errors
    /// Out of device memory, a launch failure.
    pub(crate) fn random(
        dev: &CudaDevice,
        cfg: crate::StreamConfig,
        layers: usize,
        dims: (usize, f32),
        mut next_seed: impl FnMut() -> u64,
    ) -> Result<Self> {
        let (hidden, norm_eps) = dims;
        let (n, row) = (cfg.count, cfg.count * hidden);
        let mut f32s = |len: usize, scale: f32, offset: f32| -> Result<DeviceBuf<f32>> {
            let buf = dev.alloc_zeros(len)?;
            fill_random_f32(dev, &buf, next_seed(), scale, offset)?;
            Ok(buf)
        };
        let mut conn = |mixes: usize, scales: usize| -> Result<DevConnection> {
            Ok(DevConnection {
                proj: f32s(mixes * row, 1.0 / (row as f32).sqrt(), 0.0)?,
                base: f32s(mixes, 0.5, 0.0)?,
                scale: f32s(scales, 0.1, 1.0)?,
            })
        };
        let mix = (2 + n) * n;
        let layers = (0..layers).map(|_| Ok([conn(mix, 3)?, conn(mix, 3)?])).collect::<Result<Vec<_>>>()?;
        let head = conn(n, 1)?;
        let dims = StreamDims { streams: n, hidden, sinkhorn_iters: cfg.sinkhorn_iters, eps: cfg.eps, norm_eps };
        Ok(DevStreams { dims, layers, head, tap: StreamTap::Mean })
    }

    /// Values of one captured row for `taps` taps.
    pub(crate) fn capture_width(&self, taps: usize) -> usize {
        taps * self.tap.width(self.dims.streams, self.dims.hidden)
    }

    /// Bytes of the connections' weights.
    pub(crate) fn weight_bytes(&self) -> usize {
        let conn = |c: &DevConnection| 4 * (c.proj.len() + c.base.len() + c.scale.len());
        self.layers.iter().flatten().map(conn).sum::<usize>() + conn(&self.head)
    }

    /// The embedded rows (`residual`, `[t, hidden]`) enter as `N` copies, and the first block of a model of
    /// `layers` layers enters (its input in `residual`; the head's collapse without layers).
    pub(crate) fn enter_model(&self, dev: &CudaDevice, ws: &Workspace, t: usize, layers: usize) -> Result<()> {
        let h = self.dims.hidden;
        streams_broadcast(dev, &self.dims, ws.residual.view().prefix(t * h)?, self.streams(ws, t)?)?;
        match layers {
            0 => self.finish(dev, ws, t),
            _ => self.enter(dev, ws, t, 0, Block::Mixer),
        }
    }

    /// Layer `layer`'s `block` enters: its collapsed input goes to `residual` (`[t, hidden]`).
    fn enter(&self, dev: &CudaDevice, ws: &Workspace, t: usize, layer: usize, block: Block) -> Result<()> {
        let conn = self.layers[layer][block as usize].view();
        let collapsed = ws.residual.view().prefix(t * self.dims.hidden)?;
        Ok(streams_collapse(dev, &self.dims, self.streams(ws, t)?, &conn, collapsed, &self.mix(ws, t)?)?)
    }

    /// The block leaves (its output in `delta`, `[t, hidden]`, mixed back into the streams; `delta` left zeroed
    /// for a block that accumulates), `tap` is written if a drafter reads the layer, and `next` enters: its input
    /// goes to `residual` (the head's collapse, the final norm's input, after the last layer). Taps follow a
    /// layer's last block only: the head's tap uses `delta` as scratch, which a mixer block next overwrites.
    pub(crate) fn leave(&self, dev: &CudaDevice, ws: &Workspace, t: usize, tap: Option<Tap>, next: Next) -> Result<()> {
        debug_assert!(tap.is_none() || !matches!(next, Next::Block(_, Block::Ffn)), "a tap before a feed-forward");
        let out = ws.delta.view().prefix(t * self.dims.hidden)?;
        streams_expand(dev, &self.dims, self.streams(ws, t)?, out, &self.mix(ws, t)?)?;
        if let Some(tap) = tap {
            self.write_tap(dev, ws, t, tap)?;
        }
        match next {
            Next::Block(layer, block) => self.enter(dev, ws, t, layer, block),
            Next::Head => self.finish(dev, ws, t),
        }
    }

    /// Writes `tap` of the step's rows into `captured` (`[t, tap.width]`) as the taps read the streams.
    fn write_tap(&self, dev: &CudaDevice, ws: &Workspace, t: usize, tap: Tap) -> Result<()> {
        let (n, h, Tap { index: tap, width }) = (self.dims.streams, self.dims.hidden, tap);
        let captured = ws.captured.view().prefix(t * width)?;
        let streams = self.streams(ws, t)?;
        match self.tap {
            StreamTap::Mean => Ok(streams_mean(dev, &self.dims, streams, captured, width, tap * h)?),
            StreamTap::Raw => Ok(copy_columns(dev, streams, n * h, captured, width, tap * n * h)?),
            StreamTap::Head => {
                // `delta` is free between blocks.
                let collapsed = ws.delta.view().prefix(t * h)?;
                streams_head(dev, &self.dims, streams, &self.head.view(), self.mix(ws, t)?.mixes, collapsed)?;
                Ok(copy_columns(dev, collapsed, h, captured, width, tap * h)?)
            }
        }
    }

    /// The head's collapse of the last layer's streams into `residual`, the final norm's input.
    fn finish(&self, dev: &CudaDevice, ws: &Workspace, t: usize) -> Result<()> {
        let out = ws.residual.view().prefix(t * self.dims.hidden)?;
        let mixes = self.mix(ws, t)?.mixes;
        Ok(streams_head(dev, &self.dims, self.streams(ws, t)?, &self.head.view(), mixes, out)?)
    }

    fn streams<'w>(&self, ws: &'w Workspace, t: usize) -> Result<dflash_runtime::cuda::DevSlice<'w, f32>> {
        Ok(ws.streams.view().prefix(t * self.dims.row())?)
    }

    fn mix<'w>(&self, ws: &'w Workspace, t: usize) -> Result<StreamMix<'w>> {
        let n = self.dims.streams;
        Ok(StreamMix {
            mixes: ws.stream_mixes.view().prefix(t * (2 + n) * n)?,
            post: ws.stream_post.view().prefix(t * n)?,
            comb: ws.stream_comb.view().prefix(t * n * n)?,
        })
    }
}
