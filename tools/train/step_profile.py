"""A torch.profiler window over a few warm steps of a loop (the generator's decode pool, the training loop)."""

from __future__ import annotations

import time

import torch


class StepProfile:
    """Profiles `steps` steps of a loop once warm (from step warm_steps) with torch.profiler and prints where their
    time went: the wall time per step, the host's time inside the step (launching its work), the step's summed
    kernel time (a step is host-bound when that is well below the wall time), and the operators and
    `record_function` ranges by device time. `what` names the loop and `unit` its steps in the printed line."""

    def __init__(self, steps: int, device: torch.device, warm_steps: int, what: str, unit: str):
        self.steps, self.device, self.warm_steps, self.what, self.unit = steps, device, warm_steps, what, unit
        self.profiler = None
        self.profiled = 0
        self.started = self.step_started = self.host_s = 0.0

    def before(self, step: int) -> None:
        if self.profiler is None and self.steps > 0 and step == self.warm_steps:
            self._open()
        self.step_started = time.perf_counter()

    def _open(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.__enter__()
        self.started = time.perf_counter()

    def after(self) -> None:
        if self.profiler is None:
            return
        self.host_s += time.perf_counter() - self.step_started
        self.profiled += 1
        if self.profiled == self.steps:
            self.end()

    def end(self) -> None:
        """Closes the profile (if one is open) and prints it."""
        if self.profiler is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        ms = (time.perf_counter() - self.started) * 1e3 / self.profiled
        self.profiler.__exit__(None, None, None)
        line = (f"[{self.what}] profile of {self.profiled} {self.unit}: {ms:.2f} ms a step (wall, profiled), "
                f"{self.host_s * 1e3 / self.profiled:.2f} ms of it on the host inside the step")
        key = "cpu_time_total"
        if self.device.type == "cuda":
            key = "cuda_time_total"
            kernels = sum(e.time_range.elapsed_us() for e in self.profiler.events()
                          if e.device_type == torch.autograd.DeviceType.CUDA)
            line += f", {kernels / 1e3 / self.profiled:.2f} ms of kernels (summed device time)"
        print(line)
        print(self.profiler.key_averages().table(sort_by=key, row_limit=30), flush=True)
        self.profiler = None
