"""psctl bench: performance figures measured against a reference in the same run."""

from __future__ import annotations

import argparse

from psgrid.cluster.commands.common import add_command
from psgrid.cluster.errors import UsageError
from psgrid.psserver.protocol import SHARD_DEVICES

HELP = "performance figures: transport vs raw TCP, apply vs memcpy, the parameter server vs its floor, training"

TARGETS = ("transport", "apply", "ps", "train", "script")


def _size(text: str) -> int:
    units = {"k": 1024, "m": 1024**2, "g": 1024**3}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    factor = units.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in units else text
    value = int(float(number) * factor)
    if value < 4096 or value % 4:
        raise argparse.ArgumentTypeError(f"size must be at least 4 KiB and a multiple of 4 bytes, got {text!r}")
    return value


def _counts(text: str) -> list[int]:
    """``1M,10M`` -> [1000000, 10000000] (K and M are powers of ten: parameter counts)."""
    units = {"k": 10**3, "m": 10**6, "g": 10**9}
    values = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            values.append(int(float(part[:-1]) * units[part[-1]]) if part[-1:] in units else int(part))
        except (ValueError, IndexError):
            raise argparse.ArgumentTypeError(f"expected counts such as 1M,10M or 2,4, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"counts must be at least 1, got {text!r}")
    return values


def _names(choices):
    def parse(text: str) -> list[str]:
        names = [t.strip() for t in text.split(",") if t.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)}, got {text!r}")
        return names

    return parse


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "bench",
        help=HELP,
        description="Measure, in one run on loopback, each figure beside a reference: "
        "transport: pull+push of one shard's range through each data plane against a raw TCP echo "
        "and numpy.copyto of the same bytes; apply: the shard's optimizer against numpy.copyto; "
        "ps: updates/s of shards and workers moving a fixed gradient, against the floor of one update "
        "(two copies and the apply of P floats); train: samples/s of real training per mode, with "
        "pull/compute/push/wait per step, against the same model trained with no servers (run beside each repeat); "
        "script: your own "
        "script (-- python train.py ARGS) through psgrid, against the same script alone (psgrid.init "
        "then updates its parameters in place by plain SGD, torch.optim.SGD for a PyTorch module). "
        "Medians of repeated runs; ratios are what to compare across machines.",
        examples="""
            psctl bench transport                     # table: 4 KiB .. 256 MiB
            psctl bench transport --json > bench.jsonl
            psctl bench transport --sizes 1M,64M --repeat 9
            psctl bench apply --sizes 64M
            psctl bench ps                            # P 1M,10M,100M x S 1,2,4 x W 1,2,4,8 x each plane
            psctl bench ps --params 10M --shards 1 --workers 2 --against HEAD~1 --repeats 3
            psctl bench train --models mlp,cnn --modes sync,async,ssp --json
            psctl bench train --device gpu --hidden 4096,4096 --batch-size 512 --shards 4 --workers 1
            psctl bench train --device gpu --shard-device cpu --models mlp --modes async   # host shards
            psctl bench script --device gpu --modes sync,async --workers 1,2 -- python train.py --steps 300
        """,
    )
    p.add_argument("target", choices=TARGETS, help="transport (includes the apply rows), apply, ps, train or script")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    ps = p.add_argument_group("ps and train")
    ps.add_argument(
        "--params", type=_counts, default=[10**6, 10**7, 10**8], help="ps: model sizes in floats (default 1M,10M,100M)"
    )
    ps.add_argument("--shards", type=_counts, default=None, help="shard counts (ps default 1,2,4; train 2)")
    ps.add_argument("--workers", type=_counts, default=None, help="worker counts (ps default 1,2,4,8; train 2)")
    ps.add_argument(
        "--planes",
        type=_names(("shm", "tcp", "grpc")),
        default=None,
        help="data planes (ps default shm,tcp,grpc; train shm)",
    )
    ps.add_argument("--mode", choices=("sync", "async", "ssp"), default="async", help="ps: consistency (default async)")
    ps.add_argument("--seconds", type=float, default=2.0, help="ps: seconds each configuration runs (default 2)")
    ps.add_argument(
        "--against",
        metavar="REV",
        help="ps: also run the grid with the code of git revision REV, interleaved (the previous commit: HEAD~1)",
    )
    ps.add_argument("--repeats", type=int, default=1, help="ps and train: runs per configuration (median reported)")
    _train_arguments(p.add_argument_group("train"))
    _script_arguments(p.add_argument_group("script (after --, the command each worker runs)"))
    p.add_argument(
        "--sizes",
        type=lambda s: [_size(x) for x in s.split(",")],
        default=None,
        help="comma-separated sizes such as 4K,1M,64M (default 4K..256M)",
    )
    p.add_argument("--repeat", type=int, default=5, help="timed repeats per size (median reported; default 5)")
    p.set_defaults(func=run, user_command=None)
    return p


def _train_arguments(tr) -> None:
    tr.add_argument("--models", type=_names(("mlp", "cnn")), default=["mlp", "cnn"], help="default mlp,cnn")
    tr.add_argument(
        "--modes",
        type=_names(("sync", "async", "ssp")),
        default=["sync", "async", "ssp"],
        help="default sync,async,ssp",
    )
    tr.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="where workers compute (default cpu)")
    tr.add_argument(
        "--shard-device",
        choices=SHARD_DEVICES,
        default="auto",
        help="where the shards keep weights, optimizer state and update: gpu, cpu, or auto (the GPU "
        "when the workers compute on one; default)",
    )
    tr.add_argument(
        "--shard-placement",
        type=_names(("process", "worker")),
        default=["process"],
        help="where the shards run: process (each a process of its own; default), worker (shard i in "
        "worker i's process, GeePS' placement), or both: process,worker",
    )
    tr.add_argument("--hidden", type=_counts, default=None, help="MLP widths (default 1024,1024)")
    tr.add_argument("--batch-size", type=int, default=None, help="batch per worker (default 256)")
    tr.add_argument("--steps", type=int, default=None, help="steps per worker (default 60)")
    tr.add_argument(
        "--pull-ahead",
        action="store_true",
        help="async and ssp: pull the next step's weights during this step's compute (pull_ahead = true)",
    )


def _script_arguments(sc) -> None:
    sc.add_argument("--skip", type=int, default=30, help="steps of each worker left out of samples/s (default 30)")
    sc.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help='a job-file key of the runs through psgrid, e.g. --set wire_dtype="bfloat16" (repeatable)',
    )


def run(args: argparse.Namespace) -> int:
    from psgrid.cluster.bench.transport import run as bench

    if args.target == "ps":
        from psgrid.cluster.bench import ps as bench_ps

        bench_ps.run(
            args.params,
            args.shards or [1, 2, 4],
            args.workers or [1, 2, 4, 8],
            args.planes or list(bench_ps.PLANES),
            args.mode,
            args.seconds,
            args.against,
            max(1, args.repeats),
            args.json,
        )
        return 0
    if args.target == "train":
        from psgrid.cluster.bench import train as bench_train

        bench_train.run(
            models=args.models,
            modes=args.modes,
            device=args.device,
            shards=args.shards or [2],
            workers=args.workers or [2],
            planes=args.planes or ["shm"],
            hidden=args.hidden or [1024, 1024],
            batch_size=args.batch_size or 256,
            steps=args.steps or 60,
            repeats=max(1, args.repeats),
            as_json=args.json,
            shard_device=args.shard_device,
            pull_ahead=args.pull_ahead,
            placements=args.shard_placement,
        )
        return 0
    if args.target == "script":
        return _script(args)
    if args.user_command is not None:
        raise UsageError(
            f"psctl bench {args.target} runs no command of yours: leave out the -- and what follows it "
            f"(psctl bench script takes one)"
        )
    what = ("transport", "apply") if args.target == "transport" else ("apply",)
    bench(sizes=args.sizes, repeat=max(1, args.repeat), as_json=args.json, what=what)
    return 0


def _script(args: argparse.Namespace) -> int:
    from psgrid.cluster.bench import script
    from psgrid.cluster.job.config import parse_assignment

    if not args.user_command:
        raise UsageError(
            "psctl bench script needs the command each worker runs after --, e.g. psctl bench script -- python train.py"
        )
    shards = args.shards or [1]
    if len(shards) != 1:
        raise UsageError("psctl bench script takes one --shards count")
    settings = dict(parse_assignment(text) for text in args.set)
    script.run(
        args.user_command,
        modes=args.modes,
        workers=args.workers or [1],
        shards=shards[0],
        device=args.device,
        shard_device=args.shard_device,
        repeats=max(1, args.repeats),
        skip=max(0, args.skip),
        settings=settings,
        as_json=args.json,
        placements=args.shard_placement,
    )
    return 0
