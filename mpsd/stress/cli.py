# `mpsd-stress WORKLOAD.toml`: the question users come with, "what happens to my latency-critical service
# when a training job shares the GPU, under MPS, time-slicing or MIG, with these quotas?", answered by
# playing the workload under each policy asked for (real processes against a fresh daemon on its virtual clock,
# or every tenant as a task beside a daemon in this process with --virtual-time: the same figures, without
# processes), each tenant group also alone for its isolation baseline, then one table per policy,
# one table across policies, and on request every figure as JSON and a report directory of plots and traces.
# Exit codes: 0 done, 1 a run failed, 2 a bad workload or option (one line on stderr, no traceback), 130 on Ctrl-C.
"""The mpsd-stress command."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from mpsd.runtime.dispatch_policies import kernel_policy
from mpsd.sim import H200, POLICIES, Simulator
from mpsd.sim.policies.mig import MigPolicy
from mpsd.stress.metrics import latency_summary, summarize
from mpsd.stress.runner import Progress, RunError, device_policies, run_real, run_virtual
from mpsd.record.timeline import Timeline
from mpsd.stress.workload import TenantSpec, Workload, WorkloadError, load_workload
from mpsd_protocol import format_size

__all__ = ["main"]

# settings for the daemon's dispatcher, not for a policy
DISPATCH_KEYS = ("dispatch", "kernels_in_flight", "dispatch_reaction")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpsd-stress", description="Run a multi-tenant workload on mpsd's GPU under one or more scheduling "
                                        "policies and report latency, throughput, fairness and isolation. "
                                        "`mpsd-stress sweep SWEEP.toml` runs it at many points of settings.")
    parser.add_argument("workload", type=Path, help="a workload TOML file (see examples/workloads/)")
    parser.add_argument("--policy", help=f"the policy: {', '.join(POLICIES)}, or one written in Python as "
                                         "module:Class (mpsd.sim.Policy) (default: the workload's, or mps)")
    parser.add_argument("--compare-policies", metavar="P1,P2,...",
                        help="run the workload under each policy and compare them side by side")
    parser.add_argument("--virtual-time", action="store_true",
                        help="run the tenants as tasks beside a daemon in this process, on its virtual clock: no "
                             "processes, the same figures as real processes give")
    parser.add_argument("--clock", choices=("virtual", "wall"), default="virtual",
                        help="real processes: the daemon's clock. virtual (default): the figures are an H200's "
                             "for the tenants' calls, whatever this host's speed and load; wall: simulated time "
                             "follows the wall clock x --time-scale, and this host's speed shows in the figures")
    parser.add_argument("--devices", metavar="cuda:N",
                        help="run the tenants against a real GPU (the daemon's --devices; wall clock; the device's "
                             "figures come from its traced kernels' records of each block)")
    parser.add_argument("--dispatch", choices=("block", "kernel"), default="block",
                        help="where the policy acts on the simulated H200: block (its block scheduler, the default) "
                             "or kernel (the daemon's dispatcher in front of MPS's blocks, as on a real GPU, where "
                             "a policy other than mps always acts by kernel)")
    parser.add_argument("--dispatch-reaction", type=float, metavar="SECONDS",
                        help="with --dispatch kernel: the daemon's reaction on a real GPU, modelled (the daemon's "
                             "--dispatch-reaction; 0.0001 is mpsd's on an H200), so that the figures predict the GPU's")
    parser.add_argument("--duration", type=float, metavar="SECONDS", help="override [run] duration")
    parser.add_argument("--time-scale", type=float, default=1.0, metavar="S",
                        help="with --clock wall: run the daemon's GPU at S x real speed (0.25: 4x slower), so that "
                             "host time weighs less; times reported are simulated")
    parser.add_argument("--scale", type=int, default=1, metavar="K", help="K times as many copies of every tenant")
    parser.add_argument("--no-solo", action="store_true",
                        help="skip the runs of each tenant group alone (no isolation figures)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure as JSON ('-' for stdout)")
    parser.add_argument("--report", type=Path, metavar="DIR",
                        help="write latency CDFs, SM occupancy plots and Perfetto traces there")
    parser.add_argument("--quiet", action="store_true", help="no live progress display")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["sweep"]:  # `mpsd-stress sweep SWEEP.toml`: many runs of one workload (sweep_cli.py)
        from mpsd.stress.sweep_cli import main as sweep

        return sweep(args[1:])
    options = build_parser().parse_args(args)
    try:
        workload = _adjust(load_workload(options.workload), options)
        policies = _policies(workload, options)
    except WorkloadError as exc:
        print(f"mpsd-stress: {exc}", file=sys.stderr)
        return 2
    console = _console(options)
    wall = options.clock == "wall" and not options.virtual_time
    results: dict[str, Any] = {"workload": workload.source, "in_process": options.virtual_time,
                               "clock": "wall" if wall else "virtual",
                               "time_scale": options.time_scale if wall else 1.0,
                               "duration_s": workload.duration, "runs": {}}
    runs: dict[str, Timeline] = {}
    try:
        for policy, policy_options in policies.items():
            per_device = device_policies(workload, policy, policy_options)
            tenants = _place_in_partitions(workload.tenants, per_device)
            play = _player(workload, policy, policy_options, options, console)
            solo = {} if options.no_solo or not workload.solo else _solo_p99(tenants, play)
            played = play(tenants, policy)
            # Several devices: a run per device, each under its own policy, side by side as policies are.
            timelines = [(index, _label(policy, index, per_device), timeline) for index, timeline in played.items()] \
                if isinstance(played, dict) else [(None, policy, played)]
            for index, label, timeline in timelines:
                runs[label] = timeline
                summary = summarize(timeline, solo)
                summary["solo_p99_ms"] = {name: p99 * 1e3 for name, p99 in solo.items()
                                          if any(t.name == name for t in timeline.tenants)}
                if index is not None:
                    summary["device"], summary["policy"] = index, label
                results["runs"][label] = summary
                console.print(render_run(summary))
    except (RunError, ValueError) as exc:
        print(f"mpsd-stress: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the runner has already stopped its tenants and its daemon
        print("mpsd-stress: interrupted", file=sys.stderr)
        return 130
    if len(runs) > 1:
        devices = workload.devices > 1 and len(policies) == 1
        console.print(render_comparison(results["runs"], runs, "devices compared" if devices else "policies compared"))
    if options.json is not None:
        text = json.dumps(results, indent=1, allow_nan=False)  # summaries hold None, never NaN
        if str(options.json) == "-":
            print(text)
        else:
            options.json.parent.mkdir(parents=True, exist_ok=True)
            options.json.write_text(text)
    if options.report is not None:
        from mpsd.stress.report import write_report  # matplotlib only when a report is asked for

        written = write_report(options.report, runs, results["runs"])
        console.print(f"report: {len(written)} files in {options.report}/")
    return 0


# -- set-up -----------------------------------------------------------------------------------------------

def _adjust(workload: Workload, options: argparse.Namespace) -> Workload:
    if options.scale < 1:
        raise WorkloadError("--scale must be at least 1")
    if options.duration is not None and not options.duration > 0:
        raise WorkloadError("--duration must be positive")
    if not 0 < options.time_scale <= 100:
        raise WorkloadError("--time-scale must be in (0, 100]")
    if options.time_scale != 1.0 and (options.clock != "wall" or options.virtual_time):
        raise WorkloadError("--time-scale goes with --clock wall (the virtual clock follows no wall clock)")
    if options.devices is not None and workload.devices > 1:
        raise WorkloadError("--devices names one real GPU; this workload's tenants are placed on "
                            f"{workload.devices} simulated ones (the two-GPU real backend is not built yet)")
    if options.devices is not None:
        if not options.devices.startswith("cuda:") or options.virtual_time or options.time_scale != 1.0:
            raise WorkloadError("--devices names a real GPU (cuda:N), which runs on the wall clock at its own "
                                "speed: not with --virtual-time or --time-scale")
        options.clock = "wall"
    tenants = tuple(t if t.ipc == "producer" else dataclasses.replace(t, count=t.count * options.scale)
                    for t in workload.tenants)
    return dataclasses.replace(workload, tenants=tenants, duration=options.duration or workload.duration)


def _policies(workload: Workload, options: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Policy -> its options ([run.policy_options.<policy>] of the workload), checked by the simulator."""
    if options.compare_policies:
        names = [p.strip() for p in options.compare_policies.split(",") if p.strip()]
    else:
        names = [options.policy or workload.policy]
    # A real GPU's block scheduler is its own: a policy acts there by kernel, as --dispatch kernel has it act in
    # front of the simulator.
    kernel = options.dispatch == "kernel" or options.devices is not None
    out = {}
    for name in names:
        if name not in POLICIES and ":" not in name:
            raise WorkloadError(f"unknown policy {name!r} (known: {', '.join(POLICIES)}, or module:Class)")
        settings = workload.policy_options.get(name, {})
        if not isinstance(settings, dict):
            raise WorkloadError(f"[run.policy_options.{name}] must be a table")
        if kernel and name != "mps":
            try:
                kernel_policy(name, {k: v for k, v in settings.items() if k not in DISPATCH_KEYS})
            except ValueError as exc:
                raise WorkloadError(f"--dispatch kernel: [run.policy_options.{name}]: {exc}") from None
            settings = {**settings, "dispatch": "kernel"}
            if options.dispatch_reaction is not None:
                if options.devices is not None:
                    raise WorkloadError("--dispatch-reaction models a real GPU's daemon: not with --devices")
                settings["dispatch_reaction"] = options.dispatch_reaction
        else:
            try:
                Simulator(H200, policy=name, policy_options={k: v for k, v in settings.items()
                                                             if k not in DISPATCH_KEYS})
            except ValueError as exc:
                raise WorkloadError(f"[run.policy_options.{name}]: {exc}") from None
        try:
            device_policies(workload, name, settings)
        except RunError as exc:
            raise WorkloadError(str(exc)) from None
        out[name] = settings
    return out


def _label(policy: str, index: int, per_device: list[tuple[Any, dict[str, Any]]]) -> str:
    """A device's run as the tables name it: "GPU N (its policy)"."""
    name = per_device[index][0]
    return f"GPU {index} ({name if isinstance(name, str) else policy})"


def _place_in_partitions(tenants: tuple[TenantSpec, ...],
                         per_device: list[tuple[Any, dict[str, Any]]]) -> list[TenantSpec]:
    """On a device under mig, tenants without a partition are dealt out over the partitions, one tenant group
    each in turn, as an administrator would place them; the others run as written. Under any other policy there
    are no partitions to name, so a tenant's is dropped (a workload written for MIG compares with the others)."""
    out, dealt = [], [0] * len(per_device)
    for t in tenants:
        policy, options = per_device[t.device]
        if policy != "mig":
            out.append(dataclasses.replace(t, partition=None))
            continue
        mig = Simulator(H200, policy="mig", policy_options=options).policy
        assert isinstance(mig, MigPolicy)
        count = len(mig.partitions)
        out.append(t if t.partition is not None else dataclasses.replace(t, partition=dealt[t.device] % count))
        dealt[t.device] += 1
    return out


def _player(workload: Workload, policy: str, policy_options: dict[str, Any], options: argparse.Namespace,
            console: Any) -> Callable[..., Any]:
    """A function that plays some of the workload's tenants under the policy and returns the timeline (on
    several devices, one per device)."""
    by_device = workload.devices > 1  # then a timeline per device

    def play(tenants: list[TenantSpec], label: str, device_trace: bool = True) -> Any:
        with _live(console, options.quiet) as show:
            if options.virtual_time:
                return run_virtual(workload, policy, policy_options, tenants, on_progress=show, label=label,
                                   by_device=by_device, device_trace=device_trace)
            return run_real(workload, policy, policy_options, tenants, on_progress=show, label=label,
                            time_scale=options.time_scale, clock=options.clock, devices=options.devices,
                            by_device=by_device, device_trace=device_trace)

    return play


def _solo_p99(tenants: list[TenantSpec], play: Callable[..., Any]) -> dict[str, float]:
    """Each tenant group alone (one copy, with its IPC producer if it needs one): its p99, in seconds, for every
    copy of the group. Its requests are all that is read of such a run, so the daemon records no device trace."""
    out: dict[str, float] = {}
    by_name = {t.name: t for t in tenants}
    for t in tenants:
        one = dataclasses.replace(t, count=1)
        alone = [by_name[t.ipc_peer], one] if t.ipc == "consumer" and t.ipc_peer in by_name else [one]
        timeline = play(alone, f"{t.name} alone", device_trace=False)
        if isinstance(timeline, dict):  # a timeline per device: the group's own
            timeline = timeline[t.device]
        latencies = [r.latency for r in timeline.requests if r.tenant == one.instance(0) and r.error is None]
        p99 = latency_summary(latencies)["p99"]
        if p99 is not None:
            out.update({t.instance(c): p99 / 1e3 for c in range(t.count)})
    return out


# -- output -----------------------------------------------------------------------------------------------

def render_run(summary: dict[str, Any]) -> Any:
    """One policy's run: a row per tenant and one for everyone."""
    from rich.table import Table

    mode = "virtual clock" if summary["virtual"] else "wall clock"
    what = summary["policy"] if "device" in summary else f"policy {summary['policy']}"  # "GPU N (its policy)"
    table = Table(title=f"{what} ({mode}, {summary['duration_s']:.2f} s)", title_justify="left")
    for column in ("tenant", "done", "err", "req/s", "p50 ms", "p99 ms", "p99.9 ms", "SLO", "isolation",
                   "SM share", "due", "SMs/cap", "wait ms", "mem high"):
        table.add_column(column, justify="left" if column == "tenant" else "right")
    for t in summary["tenants"]:
        lat = t["latency_ms"]
        table.add_row(t["tenant"], str(t["completed"]), str(t["errors"]), f"{t['throughput_per_s']:.1f}",
                      _ms(lat["p50"]), _ms(lat["p99"]), _ms(lat["p99.9"]), _pct(t["slo_attainment"]),
                      "-" if t["isolation"] is None else f"{t['isolation']:.2f}x", _pct(t["sm_share"]),
                      _pct(t["entitlement"]), f"{_n(t['max_sms'])}/{_n(t['sm_cap'])}", _n(t["longest_wait_ms"], ".2f"),
                      format_size(t["memory_high_water"]))
    lat = summary["latency_ms"]
    table.add_row("all", str(summary["completed"]), str(summary["errors"]), f"{summary['throughput_per_s']:.1f}",
                  _ms(lat["p50"]), _ms(lat["p99"]), _ms(lat["p99.9"]), "", "", "", "", "", "", "", style="bold")
    table.caption = (f"Jain's fairness {summary['jain_index']:.3f} · SM-time used {summary['sm_seconds']:.2f} s · "
                     f"idle SM-time while work was queued {summary['idle_sm_seconds_while_queued']:.3f} s · "
                     f"quota violations {summary['quota_violations']}" if summary["sm_seconds"] is not None else
                     "The device was not traced: its figures (SM share, SMs held, "
                     "waits, fairness, quota violations) are unknown; memory is each context's own peak.")
    if summary["lag_ms"] > 1.0:
        table.caption += (f"\nThe daemon's model fell up to {summary['lag_ms']:.1f} ms behind the wall clock: too many "
                          "blocks a second to simulate in real time, so device times stretched. Run with --clock "
                          "virtual.")
    failed = [f"{t['tenant']}: " + ", ".join(f"{count} x {name}" for name, count in t["errors_by_name"].items())
              for t in summary["tenants"] if t["errors_by_name"]]
    if failed:
        table.caption += "\nErrors: " + "; ".join(failed)
    if summary["host_time_warning"]:
        table.caption += f"\nWarning: {summary['host_time_warning']}."
    table.caption_justify = "left"
    return table


def render_comparison(summaries: dict[str, dict[str, Any]], runs: dict[str, Timeline],
                      title: str = "policies compared") -> Any:
    """Policies (or a run's devices) side by side: per tenant group, p99 and throughput; then the device-wide
    figures."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("", justify="left")
    for policy in summaries:
        table.add_column(policy, justify="right")
    groups = list(dict.fromkeys(t["group"] for s in summaries.values() for t in s["tenants"]))
    for group in groups:
        p50, p99, rate, slo = [], [], [], []
        for policy, summary in summaries.items():
            rows = [t for t in summary["tenants"] if t["group"] == group]
            names = {t["tenant"] for t in rows}
            latencies = [r.latency for r in runs[policy].requests if r.tenant in names and r.error is None]
            summary = latency_summary(latencies)
            p50.append(_ms(summary["p50"]))
            p99.append(_ms(summary["p99"]))
            rate.append(f"{sum(t['throughput_per_s'] for t in rows):.1f}")
            attained = [t["slo_attainment"] for t in rows if t["slo_attainment"] is not None]
            slo.append(_pct(sum(attained) / len(attained)) if attained else "-")
        table.add_row(f"{group} p50 ms", *p50)
        table.add_row(f"{group} p99 ms", *p99)
        table.add_row(f"{group} req/s", *rate)
        if any(s != "-" for s in slo):
            table.add_row(f"{group} SLO", *slo)
    table.add_row("Jain's fairness", *(_n(s["jain_index"], ".3f") for s in summaries.values()))
    table.add_row("SM-time used s", *(_n(s["sm_seconds"], ".2f") for s in summaries.values()))
    table.add_row("idle SM-s, work queued", *(_n(s["idle_sm_seconds_while_queued"], ".3f") for s in summaries.values()))
    table.add_row("quota violations", *(_n(s["quota_violations"]) for s in summaries.values()))
    return table


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _n(value: float | None, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def _console(options: argparse.Namespace) -> Any:
    from rich.console import Console

    # With the JSON on stdout, the tables go to stderr so that stdout stays parseable. Piped into a file or
    # a CI log, the tables keep their full width instead of rich's 80 columns.
    console = Console(stderr=str(options.json) == "-", highlight=False)
    if not console.is_terminal:
        console = Console(stderr=str(options.json) == "-", highlight=False, width=180)
    return console


class _live:
    """The live display of a real run: tenants' progress as they report it; where stderr is no terminal (a log,
    CI), a line at each change of phase and every LINE_EVERY seconds while it runs, with what is left."""

    LINE_EVERY = 5.0

    def __init__(self, console: Any, quiet: bool) -> None:
        self.console, self.quiet = console, quiet
        self.live: Any = None
        self._said: tuple[str, float] = ("", -math.inf)  # the phase last said, and when

    def __enter__(self) -> Callable[[Progress], None]:
        if self.quiet:
            return lambda progress: None
        if not self.console.is_terminal:
            return self._line
        from rich.live import Live

        self.live = Live(console=self.console, refresh_per_second=8, transient=True)
        self.live.__enter__()
        return lambda progress: self.live.update(_progress_table(progress))

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def _line(self, progress: Progress) -> None:
        now = time.monotonic()
        phase, at = self._said
        if progress.phase == phase and now - at < self.LINE_EVERY:
            return
        self._said = (progress.phase, now)
        done = ", ".join(f"{group} {sum(progress.completed.get(n, 0) for n in names)} done"
                         for group, names in progress.groups.items())
        clock = ""
        if progress.phase == "running" and progress.wall:
            elapsed = min(progress.elapsed(), progress.duration)
            clock = f" {elapsed:.1f} / {progress.duration:.1f} s, about {progress.duration - elapsed:.1f} s left;"
        print(f"mpsd-stress: {progress.policy}: {progress.phase}{clock} {done}", file=sys.stderr, flush=True)


def _progress_table(progress: Progress) -> Any:
    from rich.table import Table

    elapsed = progress.elapsed()
    table = Table(title=f"{progress.policy}: {progress.phase}, {min(elapsed, progress.duration):.1f} / "
                        f"{progress.duration:.1f} s", title_justify="left")
    for column in ("tenant group", "processes", "done", "failed", "req/s"):
        table.add_column(column, justify="left" if column == "tenant group" else "right")
    for group, names in progress.groups.items():
        done = sum(progress.completed.get(n, 0) for n in names)
        failed = sum(progress.failed.get(n, 0) for n in names)
        rate = done / elapsed if elapsed > 0 else 0.0
        table.add_row(group, str(len(names)), str(done), str(failed), f"{rate:.1f}")
    return table


if __name__ == "__main__":
    sys.exit(main())
