"""psctl worker: one training worker."""

from __future__ import annotations

import argparse

from psgrid.cluster.commands.common import add_command, add_config_arg, add_set_arg, add_token_arg, add_training_flags

HELP = "run one training worker against running shards"

EXAMPLES = """
psctl worker --config examples/mnist.toml --addresses 127.0.0.1:41234,127.0.0.1:41235 --rank 0 --world 2
psctl worker --config job.toml --addresses node1:50051 --rank 3 --world 8 --metrics worker-3.jsonl --device gpu
"""

_TRAIN_ONLY = (
    "model",
    "dataset",
    "batch_size",
    "steps",
    "epochs",
    "eval_every",
    "device",
    "wire_dtype",
    "data_plane",
    "seed",
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "worker",
        help=HELP,
        description="Train worker RANK of WORLD to completion against the given shards, appending JSON lines "
        "of metrics to --metrics, and print the worker's result as one JSON line. Settings come "
        "from the [train] table of --config, then from these flags.",
        examples=EXAMPLES,
    )
    add_config_arg(p, "mnist", "its [train] table is the base that flags override")
    p.add_argument(
        "--addresses",
        metavar="HOST:PORT,...",
        help="every shard's address, in shard order (required unless --host-shard)",
    )
    p.add_argument(
        "--host-shard",
        type=int,
        metavar="I",
        help="first start shard I of the job in this process, serving it by calls, publish its address "
        "in --address-dir and take the others' from there; serve it on after training until a "
        'Shutdown or a signal ([job] shard_placement = "worker": psctl launch does this)',
    )
    p.add_argument("--address-dir", metavar="DIR", help="with --host-shard: where every shard publishes shard-I")
    p.add_argument("--rank", type=int, default=0, help="this worker's rank, 0..WORLD-1 (default 0)")
    p.add_argument("--world", type=int, default=None, help="number of workers (default: [job] workers)")
    p.add_argument("--metrics", metavar="FILE", help="append JSON lines of metrics here")
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="BLAS/OpenMP threads (default: $OMP_NUM_THREADS if set, else this machine's CPUs / WORLD, "
        "as psctl launch gives its workers)",
    )
    add_token_arg(p)
    add_set_arg(p)
    add_training_flags(p, _TRAIN_ONLY)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import json

    from psgrid.cluster.commands.common import flag_names, load_job_from_args, split_addresses
    from psgrid.cluster.commands.server import check_files
    from psgrid.cluster.errors import UsageError
    from psgrid.cluster.run.preflight import check_device, probe_shards
    from psgrid.cluster.run.procs import limit_blas_threads, usable_cpus
    from psgrid.psserver.lifeline import watch

    job = load_job_from_args(args)
    check_files(job.train, ("tls_cert", "tls_key", "tls_ca"))
    hosting = args.host_shard is not None
    if hosting and not (args.address_dir and 0 <= args.host_shard < job.shards and args.addresses is None):
        raise UsageError(
            f"--host-shard I needs --address-dir and no --addresses, and I in 0..{job.shards - 1} "
            f"([job] shards of --config)"
        )
    if not hosting and not args.addresses:
        raise UsageError("--addresses is required: every shard's host:port, in shard order")
    addresses = [] if hosting else split_addresses(args.addresses)
    world = job.workers if args.world is None else args.world
    if not 0 <= args.rank < world:
        raise UsageError(f"--rank must be in 0..{world - 1} for --world {world}, got {args.rank}")
    check_device(job.train, flag_names(args))
    watch()  # a second call when psctl's bootstrap watches already: it covers a start through `psctl`
    # Started by hand, nobody set OMP_NUM_THREADS for us: W workers each starting one BLAS thread per core made
    # a small model 30x slower than under psctl launch, which gives each worker CPUs / W (as here, unless set).
    limit_blas_threads(args.threads or max(1, usable_cpus() // world))
    if hosting:
        from pathlib import Path

        from psgrid.cluster.run.hosting import run_hosting_worker

        run_hosting_worker(job, args.host_shard, Path(args.address_dir), args.rank, world, args.metrics)
        return 0
    probe_shards(addresses, job.train)  # unreachable, or a TLS handshake that fails: said now, with the reason
    from psgrid.worker.loop import run_worker

    result = run_worker(job.train, addresses, args.rank, world, metrics_path=args.metrics)
    print(json.dumps(result), flush=True)
    return 0
