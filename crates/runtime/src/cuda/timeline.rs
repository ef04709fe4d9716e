//! A launch timeline for diagnosis (`DFLASH_KERNEL_TIMELINE=1`): an event is recorded after every launch on a
//! device's stream (our kernels and cuBLAS's GEMMs), so each launch's GPU time is the time between its event and
//! the one before it. It works where no profiler reads the hardware counters (the gVisor machines).
//!
//! Callers cut the timeline into sections ([`CudaDevice::timeline_section`]): the section that closes is waited
//! for and returned with every launch's time. No event is recorded while the stream is being captured into a
//! graph, and a replay records none, so its time falls to the next launch that does: code that wants its launches
//! seen runs eagerly while [`CudaDevice::timeline_on`] (the drafter's passes and the target's steps do). Each time
//! includes an event's own cost, a few microseconds, so the timeline ranks launches rather than timing a graph.
//! Off by default: a launch then costs one branch more.

use std::fmt;
use std::sync::Mutex;

use cudarc::driver::sys::{self, CUevent_flags};
use cudarc::driver::CudaEvent;

use super::device::CudaDevice;
use super::{CudaError, Result};

/// The open section of a device's timeline.
#[derive(Default)]
pub(crate) struct Timeline {
    open: Option<Section>,
}

impl fmt::Debug for Timeline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let open = self.open.as_ref().map(|s| (&s.name, s.marks.len()));
        f.debug_struct("Timeline").field("open", &open).finish()
    }
}

struct Section {
    name: String,
    start: CudaEvent,
    /// One event after each launch, with what was launched.
    marks: Vec<(String, CudaEvent)>,
}

/// A closed section: what each launch was and its GPU time.
#[derive(Debug, Clone, PartialEq)]
pub struct TimelineReport {
    pub name: String,
    /// `(launch, microseconds)` in launch order.
    pub launches: Vec<(String, f64)>,
}

impl TimelineReport {
    /// The section's GPU time, from its start to its last launch's end, in microseconds.
    pub fn total_us(&self) -> f64 {
        self.launches.iter().map(|(_, us)| us).sum()
    }
}

impl fmt::Display for TimelineReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {:.1} us in {} launches", self.name, self.total_us(), self.launches.len())?;
        for (i, (what, us)) in self.launches.iter().enumerate() {
            write!(f, "\n  {i:>3} {us:>8.1} us  {what}")?;
        }
        Ok(())
    }
}

impl CudaDevice {
    /// Whether launches are being timed (`DFLASH_KERNEL_TIMELINE=1`).
    pub fn timeline_on(&self) -> bool {
        self.timeline.is_some()
    }

    /// Closes the open section (waiting for the stream) and opens one named `name`. Returns the closed section,
    /// or `None` when the timeline is off or no section was open.
    ///
    /// # Errors
    /// A driver failure recording or reading the events.
    pub fn timeline_section(&self, name: impl FnOnce() -> String) -> Result<Option<TimelineReport>> {
        let Some(timeline) = &self.timeline else { return Ok(None) };
        let mut timeline = lock(timeline);
        let closed = timeline.open.take().map(|s| self.close(s)).transpose()?;
        let start = self.timeline_event()?;
        timeline.open = Some(Section { name: name(), start, marks: Vec::new() });
        Ok(closed)
    }

    /// Records an event after a launch of `what` (nothing while the timeline is off, no section is open or the
    /// stream is capturing).
    pub(crate) fn timeline_mark(&self, what: impl FnOnce() -> String) {
        let Some(timeline) = &self.timeline else { return };
        if self.capturing() {
            return;
        }
        let mut timeline = lock(timeline);
        let Some(section) = timeline.open.as_mut() else { return };
        // A failed event only loses this launch's line; the launch itself went through.
        if let Ok(event) = self.timeline_event() {
            section.marks.push((what(), event));
        }
    }

    fn close(&self, section: Section) -> Result<TimelineReport> {
        self.synchronize()?;
        let mut before = &section.start;
        let mut launches = Vec::with_capacity(section.marks.len());
        for (what, event) in &section.marks {
            let ms = before.elapsed_ms(event).map_err(CudaError::driver("cuEventElapsedTime"))?;
            launches.push((what.clone(), f64::from(ms) * 1e3));
            before = event;
        }
        Ok(TimelineReport { name: section.name, launches })
    }

    fn timeline_event(&self) -> Result<CudaEvent> {
        let event = self
            .context()
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(CudaError::driver("cuEventCreate"))?;
        event.record(self.stream()).map_err(CudaError::driver("cuEventRecord"))?;
        Ok(event)
    }

    /// Whether the stream is being captured into a graph.
    fn capturing(&self) -> bool {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the stream is live for the device's life; the status is a plain out-parameter.
        let ok = unsafe { sys::cuStreamIsCapturing(self.stream().cu_stream(), &raw mut status) }.result().is_ok();
        !ok || status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
    }
}

fn lock(timeline: &Mutex<Timeline>) -> std::sync::MutexGuard<'_, Timeline> {
    timeline.lock().unwrap_or_else(|p| p.into_inner())
}

/// A kernel's name as the driver knows it, for timeline lines.
pub(crate) fn function_name(func: &cudarc::driver::CudaFunction) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: the function handle is live; on success the driver returns a NUL-terminated string it owns.
    let ok = unsafe { sys::cuFuncGetName(&raw mut name, func.cu_function()) }.result().is_ok();
    if !ok || name.is_null() {
        return "kernel".into();
    }
    // SAFETY: checked non-null above; the driver keeps the string alive with the module.
    unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy().into_owned()
}
