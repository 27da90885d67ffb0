"""Where a script's sync step over CUDA IPC spends its time, on one clock across the worker and the shard.

    python benchmarks/ipc_step_timeline.py --mode sync --layers 3 --steps 300
    python benchmarks/ipc_step_timeline.py --cpu --steps 100      # a check of this script: shm plane, NumPy

``examples/train_cupy.py``'s MLP (64 inputs, ``--layers`` x ``--hidden``, batch 512) through
``psgrid.init`` against one device shard in a process of its own. Both processes time the same
calls with ``time.perf_counter`` (CLOCK_MONOTONIC on Linux: one clock for every process of the
host), by wrapping them in this benchmark only: nothing in psgrid changes. The worker's and the
shard's events of each step are then put side by side, and the medians of the gaps printed:
what the worker does, what the shard does, and the time between (a frame crossing, a thread
waking, the GPU moving between the two processes' contexts). The same model alone, in this
process, is the reference.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EVENTS = "PSGRID_TIMELINE_EVENTS"


class Recorder:
    """(name, start, end) of each wrapped call, in memory; written as JSON lines at exit."""

    def __init__(self, path: str | None):
        self.path, self.events, self.lock = path, [], threading.Lock()
        if path:
            atexit.register(self.write)

    def wrap(self, owner, attr: str, name: str | None = None, label=None) -> None:
        if attr not in vars(owner):
            return  # inherited: timed where it is defined (once)
        original = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                event = label(*args) if label else name or attr
                with self.lock:
                    self.events.append((event, t0, t1))

        setattr(owner, attr, timed)

    def write(self) -> None:
        with open(self.path, "w") as out, self.lock:
            for event in self.events:
                out.write(json.dumps(event) + "\n")


def _op_label(server, conn, request) -> str:
    from psgrid.psserver.transports.stream_frames import PULL, PUSH

    return {PUSH: "s_push", PULL: "s_pull"}.get(request.op, f"s_op{request.op}")


def shard_main() -> None:
    """``psctl server`` with the shard's side of a step timed (the wrapper this benchmark starts)."""
    from psgrid.psserver.service import ShardService
    from psgrid.psserver.state.updater import Updater
    from psgrid.psserver.transports import shm_server

    recorder = Recorder(os.environ[EVENTS])
    recorder.wrap(shm_server.ShmDataServer, "_operation", label=_op_label)
    recorder.wrap(shm_server.SharedSegment, "copy_into", "s_copy")
    recorder.wrap(ShardService, "push", "s_service")
    recorder.wrap(Updater, "apply", "s_apply")
    try:
        from psgrid.psserver.transports import ipc_server

        recorder.wrap(ipc_server.IpcDataServer, "_operation", label=_op_label)
        recorder.wrap(ipc_server.DeviceSlot, "copy_into", "s_copy")
        recorder.wrap(ipc_server.DeviceSlot, "queue_into", "s_copy")  # async: queued, checked by the update
    except ImportError:
        pass
    from psgrid.cluster.cli import main

    code = main(sys.argv[1:])
    recorder.write()
    os._exit(code or 0)


def start_shard(mode: str, lr: float, device: str, events: str):
    """``psctl server`` with its side of a step timed (:func:`shard_main`): ``(address, proc)``."""
    from script_step_ab import shard_process

    launcher = [
        sys.executable,
        "-c",
        f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
        "import ipc_step_timeline; ipc_step_timeline.shard_main()",
    ]
    server_args = ["server", "--host", "127.0.0.1", "--port", "0", "--mode", mode, "--lr", str(lr), "--device", device]
    proc, address = shard_process(launcher, server_args, env=dict(os.environ, **{EVENTS: events}))
    return address, proc


def worker_recorder() -> Recorder:
    from psgrid.psserver.transports import shm_client
    from psgrid.worker import core, model_link

    recorder = Recorder(None)
    recorder.wrap(shm_client.ShmDataPlane, "push", "w_push")
    recorder.wrap(shm_client.ShmDataPlane, "_pull", "w_pull")
    recorder.wrap(model_link.ModelLink, "weights_in", "w_weights_in")
    recorder.wrap(model_link.ModelLink, "gradients_out", "w_grads_out")
    recorder.wrap(core.WorkerCore, "pull", "w_core_pull")
    recorder.wrap(core.WorkerCore, "push", "w_core_push")
    try:
        from psgrid.psserver.transports import ipc_client

        recorder.wrap(ipc_client.IpcDataPlane, "push", "w_push")
        recorder.wrap(ipc_client.IpcDataPlane, "_pull", "w_pull")
        recorder.wrap(ipc_client.IpcDataPlane, "_fill", "w_fill")
    except ImportError:
        pass
    return recorder


def by_name(events) -> dict:
    named: dict[str, list] = {}
    for name, t0, t1 in sorted(events, key=lambda e: e[1]):
        named.setdefault(name, []).append((t0, t1))
    return named


def within(spans, t0: float, t1: float):
    """The first span of ``spans`` that starts inside [t0, t1]."""
    return next(((a, b) for a, b in spans if t0 <= a <= t1), None)


def timeline(worker_events, shard_events, skip: int) -> dict[str, list[float]]:
    """Each step's gaps (ms), named in the order they happen."""
    w, s = by_name(worker_events), by_name(shard_events)
    gaps: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        gaps.setdefault(name, []).append(1e3 * seconds)

    steps = w.get("w_core_push", [])
    pulls = w.get("w_core_pull", [])
    for i in range(skip, len(steps) - 1):
        push0, push1 = steps[i]
        wpush = within(w.get("w_push", []), push0, push1)
        if wpush is None:
            continue
        fill = within(w.get("w_fill", []), *wpush)
        grads = within(w.get("w_grads_out", []), push0 - 0.05, push0)
        spush = within(s.get("s_push", []), wpush[0], wpush[1])
        if spush is None:
            continue
        copy = within(s.get("s_copy", []), *spush)
        apply = within(s.get("s_apply", []), *spush)
        if grads:
            add("worker: gradients into the flat buffer", grads[1] - grads[0])
        add("worker: core.push until the plane's push", wpush[0] - push0)
        if fill:
            add("worker: gradient into the slot (+ wait)", fill[1] - fill[0])
        add("frame to the shard: sent -> shard handles it", spush[0] - (fill[1] if fill else wpush[0]))
        if copy:
            add("shard: copy out of the slot + check (+ wait)", copy[1] - copy[0])
        if apply:
            add("shard: update + publish (+ wait)", apply[1] - apply[0])
        add(
            "shard: the rest of the push's handling",
            (spush[1] - spush[0]) - sum((x[1] - x[0]) for x in (copy, apply) if x),
        )
        add("reply to the worker: shard answered -> push returns", wpush[1] - spush[1])
        add("worker: plane's push returns -> core.push returns", push1 - wpush[1])
        pull = next(((a, b) for a, b in pulls if a >= push1), None)
        if pull is None:
            continue
        wpull = within(w.get("w_pull", []), *pull)
        add("worker: core.push returns -> next pull", pull[0] - push1)
        if wpull is None:
            continue
        spull = within(s.get("s_pull", []), *wpull)
        add("worker: core.pull until the plane's pull", wpull[0] - pull[0])
        if spull:
            add("frame to the shard (pull)", spull[0] - wpull[0])
            add("shard: pull handled", spull[1] - spull[0])
            add("reply, mapped copy and its wait (pull)", wpull[1] - spull[1])
        weights = within(w.get("w_weights_in", []), *pull)
        if weights:
            add("worker: weights into the parameters (+ wait)", weights[1] - weights[0])
        add("worker: whole pull", pull[1] - pull[0])
        add("worker: whole push", push1 - push0)
        if i + 1 < len(steps):
            add("worker: compute (pull returns -> next core.push)", steps[i + 1][0] - pull[1])
            add("step, push to push", steps[i + 1][0] - push0)
    return gaps


def phases(worker_events, shard_events, skip: int) -> dict[str, list[float]]:
    """Each push's parts on the shard (ms), in any mode: an overlapped push's are not the step's."""
    w, s = by_name(worker_events), by_name(shard_events)
    gaps: dict[str, list[float]] = {}
    for t0, t1 in s.get("s_push", [])[skip:]:
        copy = within(s.get("s_copy", []), t0, t1)
        apply = within(s.get("s_apply", []), t0, t1)
        gaps.setdefault("shard push, header to reply", []).append(1e3 * (t1 - t0))
        if copy and apply:
            gaps.setdefault("  copy out + check (+ wait, unless queued)", []).append(1e3 * (copy[1] - copy[0]))
            gaps.setdefault("  between them (Python)", []).append(1e3 * (apply[0] - copy[1]))
            gaps.setdefault("  update + publish (+ wait)", []).append(1e3 * (apply[1] - apply[0]))
    for name, label in (("w_push", "worker: the plane's push"), ("w_pull", "worker: the plane's pull")):
        gaps[label] = [1e3 * (b - a) for a, b in w.get(name, [])[skip:]]
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="sync", choices=("sync", "async", "ssp"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--skip", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--cpu", action="store_true", help="NumPy and a host shard over shared memory")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from script_step_ab import alone_session, block, cupy_model, stop_process

    import psgrid

    params, step, synchronize = cupy_model(args.hidden, args.layers, args.batch_size, args.cpu)
    alone = alone_session(params, args.lr, args.cpu)
    for _ in range(20):
        step(alone)
    alone_before = block(step, alone, args.steps, synchronize)
    recorder = worker_recorder()
    events = tempfile.mktemp(prefix="psgrid-shard-events-")
    address, proc = start_shard(args.mode, args.lr, "cpu" if args.cpu else "gpu", events)
    try:
        ps = psgrid.init(params, addresses=[address], world=1, rank=0, metrics=os.devnull)
        for _ in range(20):
            step(ps)
        recorder.events.clear()
        ours = block(step, ps, args.steps, synchronize)
        worker_events = list(recorder.events)
        planes = "+".join(ps.client.data_planes)
        ps.close()
    finally:
        stop_process(proc, 20)
    alone_after = block(step, alone, args.steps, synchronize)
    shard_events = [tuple(json.loads(line)) for line in Path(events).read_text().splitlines()]
    os.unlink(events)
    alone_ms = 1e3 * (alone_before + alone_after) / 2
    print(
        f"{args.layers} x {args.hidden}, {args.mode}, plane {planes}: alone {alone_ms:.3f} ms a step, "
        f"psgrid {1e3 * ours:.3f} ms ({alone_ms / 1e3 / ours:.3f}x); medians over steps {args.skip}.., ms:"
    )
    parts = timeline(worker_events, shard_events, args.skip) if args.mode == "sync" else {}
    for name, values in {**parts, **phases(worker_events, shard_events, args.skip)}.items():
        if not values:
            continue
        print(
            f"  {name:<52} {statistics.median(values):7.3f}  (p10 {np.percentile(values, 10):.3f}, "
            f"p90 {np.percentile(values, 90):.3f}, n {len(values)})"
        )


if __name__ == "__main__":
    main()
