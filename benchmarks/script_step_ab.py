"""A script's step alone and through psgrid, interleaved in one process: the paired ratio, and where the time goes.

    python benchmarks/script_step_ab.py cupy-mlp --modes async,sync --placements process,worker
    python benchmarks/script_step_ab.py resnet18 --blocks 5 --steps 60 --profile

``psctl bench script`` runs the script alone and through psgrid as separate processes, minutes apart
for a whole sweep; on a shared GPU host the reference itself then moves by a fifth from one run to
the next (benchmarks/results/gpu-scripts-1xH200-run*.log). Here one process alternates blocks of
``--steps`` steps of the same model and data: alone (worker/alone.py's session: ``torch.optim.SGD``,
or ``p -= lr * g`` through CuPy views) and through ``psgrid.init`` against one device shard, in a
process of its own (``psctl server --device gpu``, reached over CUDA IPC) or in this one (the
in-process plane). Each psgrid block's ratio is to the mean of the alone blocks on either side of it;
the median over blocks is printed with each block's, and the medians of the psgrid steps' phases.
``--profile`` adds the psgrid steps' costliest functions (cProfile, main thread only; a wait for the
GPU is counted in the Python function that forced it).

Models: ``cupy-mlp`` (examples/train_cupy.py's MLP: 64 inputs, ``--hidden`` x ``--layers``, batch 512),
``resnet18`` and ``transformer`` (benchmarks/torch_models.py).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def cupy_model(hidden: int, layers: int, batch: int, cpu: bool):
    if cpu:
        cupy = np
    else:
        import cupy

    sys.path.insert(0, str(ROOT / "examples"))
    from train_cupy import init_params, loss_and_grads

    params = {k: cupy.asarray(v) for k, v in init_params([64, *[hidden] * layers, 10], 0).items()}
    rng = np.random.default_rng(0)
    x = cupy.asarray(rng.random((4096, 64), dtype=np.float32))
    y = cupy.asarray(rng.integers(0, 10, 4096))

    def step(session) -> None:
        session.pull()
        rows = cupy.asarray(rng.choice(len(y), size=batch, replace=False))
        loss, grads = loss_and_grads(cupy, params, x[rows], y[rows])
        session.push(grads, loss=loss, samples=batch)

    return params, step, (lambda: None) if cpu else (lambda: cupy.cuda.Device().synchronize())


def torch_model(name: str):
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from torch_models import model_and_batches

    torch.backends.cudnn.benchmark = True
    model, batches, batch = model_and_batches(name, torch.device("cuda:0"), None, 0)
    count = [0]

    def step(session) -> None:
        x, y = batches[count[0] % len(batches)]
        count[0] += 1
        session.pull()
        loss = F.cross_entropy(model(x), y)
        model.zero_grad()
        loss.backward()
        session.push(loss=loss, samples=batch)

    return model, step, torch.cuda.synchronize


def start_shard(mode: str, placement: str, lr: float, device: str):
    """One device shard: ``(address, stop)``."""
    if placement == "worker":
        from psgrid.psserver.config import ServerConfig
        from psgrid.psserver.server import serve

        server = serve(
            ServerConfig(host="127.0.0.1", port=0, mode=mode, lr=lr, shard_device=device, gpu=0),
            in_process_clients=True,
        )
        return server.address, lambda: server.stop(grace=1.0)
    server_args = ["server", "--host", "127.0.0.1", "--port", "0", "--mode", mode, "--lr", str(lr)]
    proc, address = shard_process([sys.executable, "-m", "psgrid.cluster.cli"], [*server_args, "--device", device])
    return address, lambda: stop_process(proc)


def shard_process(launcher: list[str], server_args: list[str], env=None) -> tuple[subprocess.Popen, str]:
    """``launcher + server_args`` (a ``psctl server`` on GPU 0) in a process of its own, once it listens: ``(proc, address)``."""
    folder = tempfile.mkdtemp(prefix="psgrid-ab-")
    address_file = Path(folder) / "address"
    proc = subprocess.Popen([*launcher, *server_args, "--gpu", "0", "--address-file", str(address_file)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not (address_file.exists() and address_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_process(proc)
                raise SystemExit(f"the shard did not start (exit {proc.poll()})")
            time.sleep(0.05)
        return proc, address_file.read_text().splitlines()[0]
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # read once: nothing else needs it


def stop_process(proc: subprocess.Popen, wait_s: float = 10) -> None:
    proc.terminate()
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def alone_session(params, lr: float, cpu: bool):
    """The model trained alone, with no servers (worker/alone.py): plain SGD at ``lr``, on GPU 0 unless ``cpu``."""
    from psgrid.worker.alone import AloneSession
    from psgrid.worker.api import named_parameters

    named = named_parameters(params)
    return AloneSession(
        params,
        names=[n for n, _ in named],
        originals=[a for _, a in named],
        lr=lr,
        momentum=0.0,
        metrics=None,
        device=None if cpu else 0,
    )


def block(step, session, steps: int, synchronize, phases: list | None = None) -> float:
    """Seconds per step (wall) over ``steps`` steps; each step's record appended to ``phases``."""
    synchronize()
    wall = time.perf_counter()
    for _ in range(steps):
        step(session)
        if phases is not None and session.last_step is not None:
            phases.append(session.last_step)
    synchronize()
    return (time.perf_counter() - wall) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=("cupy-mlp", "resnet18", "transformer"))
    parser.add_argument("--modes", default="async,sync")
    parser.add_argument("--placements", default="process,worker")
    parser.add_argument("--blocks", type=int, default=5, help="psgrid blocks per setting (alone blocks: one more)")
    parser.add_argument("--steps", type=int, default=100, help="steps per block")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--cpu", action="store_true", help="NumPy and a host shard (cupy-mlp only): a check of this script"
    )
    args = parser.parse_args()

    import psgrid
    from psgrid.worker.api import named_parameters

    if args.model == "cupy-mlp":
        params, step, synchronize = cupy_model(args.hidden, args.layers, args.batch_size, args.cpu)
    else:
        params, step, synchronize = torch_model(args.model)
    named = named_parameters(params)
    alone = alone_session(params, args.lr, args.cpu)
    for _ in range(20):  # compile kernels, cudnn's choice
        step(alone)
    print(
        f"{args.model}: {sum(int(np.prod(a.shape)) for _, a in named) / 1e6:.1f}M parameters; blocks of "
        f"{args.steps} steps; ratio = alone's step time (mean of the blocks either side) / psgrid's"
    )
    print(
        f"{'mode':>6} {'in':>7} {'plane':>6} {'alone ms':>9} {'psgrid ms':>9} {'x alone':>7}  each block"
        f"{'':>30} medians, ms: pull compute push"
    )
    for mode in args.modes.split(","):
        for placement in args.placements.split(","):
            address, stop = start_shard(mode, placement, args.lr, "cpu" if args.cpu else "gpu")
            try:
                ps = psgrid.init(params, addresses=[address], world=1, rank=0, metrics=os.devnull)
                for _ in range(20):
                    step(ps)
                alones, ours, ratios, records = [block(step, alone, args.steps, synchronize)], [], [], []
                for _ in range(args.blocks):
                    ours.append(block(step, ps, args.steps, synchronize, records))
                    alones.append(block(step, alone, args.steps, synchronize))
                    ratios.append((alones[-2] + alones[-1]) / 2 / ours[-1])
                # push_s of an overlapped push is its time in the background, not the step's
                phases = " ".join(
                    f"{1e3 * statistics.median(r.get(k, 0.0) for r in records):.2f}"
                    for k in ("pull_s", "compute_s", "push_s")
                )
                planes = "+".join(ps.client.data_planes) if hasattr(ps.client, "data_planes") else "-"
                profile = ""
                if args.profile:
                    profiler = cProfile.Profile()
                    profiler.enable()
                    block(step, ps, args.steps, synchronize)
                    profiler.disable()
                    text = io.StringIO()
                    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
                    profile = text.getvalue()
                ps.close()
            finally:
                stop()
            alone_ms, ours_ms = 1e3 * statistics.median(alones), 1e3 * statistics.median(ours)
            print(
                f"{mode:>6} {placement:>7} {planes:>6} {alone_ms:9.3f} {ours_ms:9.3f} {statistics.median(ratios):7.3f}  "
                f"{' '.join(f'{r:.2f}' for r in ratios):<40} {phases}",
                flush=True,
            )
            if profile:
                print("\n".join(profile.splitlines()[:40]), flush=True)


if __name__ == "__main__":
    main()
