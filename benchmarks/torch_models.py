"""Models users bring, trained through ``psgrid.init`` as a user's script would: for ``psctl bench script``.

    psctl bench script --device gpu --modes sync,async --workers 1,2 -- python benchmarks/torch_models.py resnet18
    psctl bench script --device gpu -- python benchmarks/torch_models.py transformer --steps 300

``resnet18``: torchvision's ResNet-18 (11.2M parameters, 10 classes) on batches of 128 images of
3 x 32 x 32; ``transformer``: ``torch.nn.TransformerEncoder``, 6 layers of width 512 with 8 heads
over a 16,384-token embedding, mean-pooled into 10 classes (27.3M parameters), on 32 sequences of
128 tokens. Synthetic data made on the worker's device (a few fixed batches in turn), so that the
figures are the exchange's and the model's, not a loader's. The loop is an ordinary PyTorch loop
with the five lines of psgrid; ``psctl bench script`` runs it alone too (``torch.optim.SGD`` in place
of the shards) and prints the ratio.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import psgrid

CLASSES = 10


class Encoder(nn.Module):
    """Token embedding, ``nn.TransformerEncoder`` and a mean-pooled classifier."""

    def __init__(self, vocab: int = 16384, width: int = 512, heads: int = 8, layers: int = 6):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


def model_and_batches(name: str, device: torch.device, batch_size: int | None, seed: int):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    if name == "resnet18":
        from torchvision.models import resnet18

        model, batch = resnet18(num_classes=CLASSES), batch_size or 128
        inputs = [torch.randn(batch, 3, 32, 32, generator=generator) for _ in range(4)]
    elif name == "transformer":
        model, batch = Encoder(), batch_size or 32
        inputs = [torch.randint(0, 16384, (batch, 128), generator=generator) for _ in range(4)]
    else:
        raise SystemExit(f"no model {name!r}: resnet18 or transformer")
    labels = [torch.randint(0, CLASSES, (batch,), generator=generator) for _ in inputs]
    return model.to(device), [(x.to(device), y.to(device)) for x, y in zip(inputs, labels)], batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=("resnet18", "transformer"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = torch.device(psgrid.job_env().device)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True
    model, batches, batch = model_and_batches(args.model, device, args.batch_size, args.seed)
    ps = psgrid.init(model)
    for step in range(args.steps):
        x, y = batches[step % len(batches)]
        ps.pull()
        loss = F.cross_entropy(model(x), y)
        model.zero_grad()
        loss.backward()
        ps.push(loss=loss, samples=batch)
    ps.close()
    if ps.rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(
            f"{args.model}: {params / 1e6:.1f}M parameters, {args.steps} steps of {batch} on {device}, "
            f"last loss {ps.final_loss:.4f}"
        )


if __name__ == "__main__":
    main()
