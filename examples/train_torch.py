"""Your own PyTorch model on the shards: a small CNN on the 8 x 8 digits, on this worker's GPU or the CPU.

    psctl launch --workers 2 -- python examples/train_torch.py
    psctl launch --workers 2 --device gpu -- python examples/train_torch.py --steps 500
    mpiexec -n 4 psctl mpi --shards 1 -- python examples/train_torch.py

An ordinary PyTorch training loop; the lines marked ``# +ps`` are all it takes to train it on the
job's shards, which hold the weights and apply the job's optimizer (``--lr``, ``--optimizer``,
``--mode`` of psctl) in place of ``optimizer.step()``. The weights land in the model's own
tensors and the gradients leave from its ``.grad``s through DLPack: no copy in another framework.

PyTorch is not a dependency of psgrid: install it where the workers run, ``pip install torch``
(for the CPU alone, a smaller wheel: ``pip install torch --index-url
https://download.pytorch.org/whl/cpu``; for a GPU, the command https://pytorch.org/get-started gives
for your CUDA).
"""

from __future__ import annotations

import argparse

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError:
    raise SystemExit(
        "examples/train_torch.py needs PyTorch, which psgrid does not install: pip install torch "
        "(PyTorch's site lists a smaller CPU-only build)"
    ) from None

import psgrid  # +ps
from psgrid.worker.data import read_shipped


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8x8 -> 4x4
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return (model(x).argmax(dim=1) == y).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=None, help="default: the job's seed (PSGRID_SEED), else 0")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else psgrid.job_env().seed or 0  # psctl compare varies it per repeat

    device = torch.device(psgrid.job_env().device)  # +ps: this worker's GPU (cuda:N), or the CPU
    torch.manual_seed(seed)
    model = make_model().to(device)
    ps = psgrid.init(model)  # +ps: join the job; the shards start from rank 0's weights

    images, labels = read_shipped("digits")  # the UCI digits scikit-learn has, shipped with psgrid
    x = torch.tensor(images / 16, dtype=torch.float32, device=device).unsqueeze(1)
    y = torch.tensor(labels, dtype=torch.int64, device=device)
    x_train, y_train = x[:1400][ps.rank :: ps.world], y[:1400][ps.rank :: ps.world]
    generator = torch.Generator(device="cpu").manual_seed(seed + ps.rank)
    loss = torch.tensor(float("nan"))
    for step in range(ps.first_step, args.steps):  # +ps: a resumed job makes only the steps that are left
        ps.pull()  # +ps: the shards' weights, in the model's parameters
        batch = torch.randperm(len(y_train), generator=generator)[: args.batch_size].to(device)
        loss = F.cross_entropy(model(x_train[batch]), y_train[batch])
        model.zero_grad()
        loss.backward()
        ps.push(loss=loss, samples=args.batch_size)  # +ps: the .grads, instead of optimizer.step()
        if ps.rank == 0 and args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            ps.log_eval(test_accuracy=accuracy(model, x[1400:], y[1400:]))
    ps.pull()  # the final weights
    final = accuracy(model, x[1400:], y[1400:])
    if ps.rank == 0:
        ps.log_eval(test_accuracy=final, train_accuracy=accuracy(model, x[:1400], y[:1400]))
    ps.close()  # +ps: leave the job
    print(
        f"worker {ps.rank} of {ps.world} (torch {torch.__version__} on {device}): {args.steps} steps, "
        f"last loss {loss.item():.4f}, test accuracy {final:.4f}"
    )


if __name__ == "__main__":
    main()
