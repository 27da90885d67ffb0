"""psctl subcommands, one module each; a module adds its parser with ``add_parser(subparsers)``.

To add a command, write ``cluster/commands/NAME.py`` with ``add_parser`` (which calls
``set_defaults(func=run)``; ``run(args)`` returns the exit code) and list it here.
Modules import their heavy dependencies (grpc, numpy, mpi4py) inside ``run`` so that
``psctl --help`` stays fast.
"""

COMMANDS = ("launch", "mpi", "compare", "allreduce", "server", "worker", "status", "bench", "certs")
