"""Where a step's time goes: a jax.profiler trace, read back (jax.profiler.ProfileData, no
other tool) into per-step figures: the device's events (kernels and copies: how many, and
the time at least one of them runs, "busy"), the step's wall time, and the device and host
events that take the most time. A device busy for most of a step is the bound; one idle for
much of it waits on the host (launches, the layer loop's control, copies back, the server's
own work). On CPU the device has no plane of its own: the host's events are the runtime's.

Two ways in: `python -m engine.bench --profile DIR` (`profile_steps`: the bench's first
requests again, their decode steps traced), and the server's /start_profile and
/stop_profile when XLASERVE_PROFILER_DIR is set (`Profiler`: whatever the process does
between the two, counted per engine step).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
from jax.profiler import ProfileData

TOP = 12  # host events listed by total time
TOP_DEVICE = 60  # device events: a step's kernels, most of them


def profile_steps(engine, requests, concurrency: int, directory: str | Path,
                  steps: int = 20) -> dict:
    """Trace `steps` decode steps of `engine` (an LLMEngine after its measured run) over the
    first `concurrency` of `requests` ((prompt, params) pairs), and summarize the trace."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests[:concurrency]]
    started: set[str] = set()
    while len(started) < len(ids) and engine.has_unfinished():  # prompts first, untraced
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    for _ in range(2):  # and a step or two of decode, so the overlapped pipeline is full
        engine.step()
    directory = Path(directory)
    traced = 0
    with jax.profiler.trace(str(directory)):
        start = time.perf_counter()
        while traced < steps and engine.has_unfinished():
            engine.step()
            traced += 1
        jax.effects_barrier()
        wall = time.perf_counter() - start
    for rid in ids:  # the rest is not measured
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    path = newest_trace(directory)
    if not traced or path is None:
        return {"steps": traced, "error": "no steps traced" if not traced else "no trace file"}
    return {"trace": str(path), **summarize_trace(path, traced, wall)}


def newest_trace(directory: Path, since: float = 0.0) -> Path | None:
    """The trace file jax.profiler wrote last under `directory` (not before `since`, a
    time.time()), or None."""
    files = [p for p in directory.glob("**/*.xplane.pb") if p.stat().st_mtime >= since]
    return max(files, key=lambda p: p.stat().st_mtime, default=None)


def _busy_ns(intervals: list[tuple[float, float]]) -> float:
    """The time covered by at least one of the (start, duration) intervals."""
    total, end = 0.0, float("-inf")
    for start, duration in sorted(intervals):
        stop = start + duration
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _top(times: collections.Counter, counts: collections.Counter, steps: int,
         n: int = TOP) -> list[dict]:
    return [{"name": name[:120], "per_step": counts[name] / steps,
             "ms_per_step": ns / 1e6 / steps} for name, ns in times.most_common(n)]


def _self_times(events, times: collections.Counter, counts: collections.Counter) -> None:
    """Add each event's own time (its duration less that of the events nested in it: one
    thread's events nest) to `times` by name, and count them."""
    stack: list[list] = []  # [end, name, duration, children's time]

    def close(entry) -> None:
        times[entry[1]] += entry[2] - entry[3]
        if stack:
            stack[-1][3] += entry[2]

    for e in sorted(events, key=lambda e: (e.start_ns, -e.duration_ns)):
        while stack and stack[-1][0] <= e.start_ns:
            close(stack.pop())
        stack.append([e.start_ns + e.duration_ns, e.name, e.duration_ns, 0.0])
        counts[e.name] += 1
    while stack:
        close(stack.pop())


def summarize_trace(path: str | Path, steps: int, wall_s: float) -> dict:
    """Per-step figures of a trace of `steps` steps that took `wall_s` seconds."""
    data = ProfileData.from_file(str(path))
    device, device_lines = [], collections.Counter()
    dev_t, dev_n = collections.Counter(), collections.Counter()
    host_t, host_n = collections.Counter(), collections.Counter()
    for plane in data.planes:
        on_device = plane.name.startswith("/device:")
        if not on_device and plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            if not on_device and line.name == "python":  # Python's own frames, not the runtime
                continue
            for e in line.events if on_device else ():
                device.append((e.start_ns, e.duration_ns))
                device_lines[f"{plane.name} {line.name}"] += 1
                dev_t[e.name] += e.duration_ns
                dev_n[e.name] += 1
            if not on_device:
                _self_times(line.events, host_t, host_n)
    busy_ms = _busy_ns(device) / 1e6 / steps
    wall_ms = wall_s * 1e3 / steps
    return {"steps": steps, "wall_ms_per_step": wall_ms,
            "device_events_per_step": len(device) / steps,
            "device_busy_ms_per_step": busy_ms if device else None,
            "device_busy_fraction": busy_ms / wall_ms if device else None,
            "device_lines": dict(device_lines),
            "top_device": _top(dev_t, dev_n, steps),
            "top_host": _top(host_t, host_n, steps)}  # by their own time, nested events apart


def describe(summary: dict) -> str:
    """A few lines for the bench's printout."""
    if "error" in summary:
        return f"profile: {summary['error']}"
    lines = [f"profile of {summary['steps']} steps: {summary['wall_ms_per_step']:.3f} ms a step"
             if "window_s" not in summary else
             f"profile of {summary['steps']} steps in a {summary['window_s']:.2f} s window"]
    if summary["device_busy_ms_per_step"] is not None:
        lines[0] += (f"; the device busy {summary['device_busy_ms_per_step']:.3f} ms a step"
                     + ("" if "window_s" in summary else
                        f" ({summary['device_busy_fraction']:.0%} of it)")
                     + f" over {summary['device_events_per_step']:.0f} events")
    lines.append("  (a step's share of each event; the host's by their own time)")
    for key, n in (("top_device", 6), ("top_host", 10)):
        for row in summary[key][:n]:
            lines.append(f"  {key[4:]:6} {row['ms_per_step']:8.3f} ms  x{row['per_step']:6.1f}  "
                         f"{row['name'][:90]}")
    return "\n".join(lines)


class ProfilerError(RuntimeError):
    """A stop with no trace running, or a start while one runs."""


class Profiler:
    """A trace of the whole process between `start` and `stop` into `directory` (the
    server's /start_profile and /stop_profile); `steps()` counts the engines' steps, so that
    the summary is per step."""

    def __init__(self, directory: str | Path, steps: Callable[[], int]):
        self.directory, self._steps = Path(directory), steps
        self._lock = threading.Lock()
        self._started: tuple[float, int] | None = None

    def start(self) -> dict:
        with self._lock:
            if self._started is not None:
                raise ProfilerError("a profile is already running: stop it first")
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self._started = time.perf_counter(), self._steps()
        return {"status": "started", "directory": str(self.directory)}

    def stop(self) -> dict:
        with self._lock:
            if self._started is None:
                raise ProfilerError("no profile is running: start one first")
            (start, steps), self._started = self._started, None
            steps, wall = self._steps() - steps, time.perf_counter() - start
            begun = time.time() - wall
            jax.profiler.stop_trace()
        path = newest_trace(self.directory, since=begun)
        if path is None:
            return {"status": "stopped", "steps": steps, "error": "no trace file"}
        if not steps:
            return {"status": "stopped", "trace": str(path), "steps": 0,
                    "error": "no engine step ran while tracing"}
        # The window holds whatever ran between the two calls, idle time too: its wall time
        # per step is no step's time (the device's busy time is).
        return {"status": "stopped", "trace": str(path), "window_s": wall,
                **summarize_trace(path, steps, wall)}
