"""Demo: the same small CNN trained plain and with compressed activations, side by side.

Run: ``bash scripts/run.sh demo`` (or ``python -m recipes.demo``).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from lightning_acgc import compress_activations


def small_cnn() -> nn.Module:
    def block(c_in: int, c_out: int, stride: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()
        )

    return nn.Sequential(
        block(1, 16, 1),
        block(16, 32, 2),
        block(32, 32, 1),
        block(32, 64, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 4),
    )


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Four classes of 32x32 images: horizontal/vertical stripes at two frequencies."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    grid = torch.arange(32, dtype=torch.float32)
    freq = torch.where(y % 2 == 0, 0.4, 0.9)[:, None, None]
    phase = torch.rand(n, 1, 1, generator=g) * 6.28
    rows = torch.sin(freq * grid[None, :, None] + phase).expand(n, 32, 32)
    cols = torch.sin(freq * grid[None, None, :] + phase).expand(n, 32, 32)
    x = torch.where((y < 2)[:, None, None], rows, cols) + 0.5 * torch.randn(n, 32, 32, generator=g)
    return x[:, None], y


def train(codec: str | None, steps: int, batch: int, seed: int, **options) -> dict:
    torch.manual_seed(seed)
    model = small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x_all, y_all = make_data(steps * batch, seed)
    saved = packed = 0
    for i in range(steps):
        x, y = x_all[i * batch : (i + 1) * batch], y_all[i * batch : (i + 1) * batch]
        opt.zero_grad()
        if codec is None:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
        else:
            with compress_activations(codec=codec, model=model, seed=i, **options) as stats:
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
            saved, packed = stats.saved_bytes, stats.packed_bytes
        opt.step()
    x_test, y_test = make_data(1024, seed + 1)
    model.eval()
    with torch.no_grad():
        acc = (model(x_test).argmax(1) == y_test).float().mean().item()
    return {
        "codec": codec or "plain",
        "acc": acc,
        "saved_mb": saved / 2**20,
        "packed_mb": packed / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    runs = [
        train(None, args.steps, args.batch, args.seed),
        train("quant", args.steps, args.batch, args.seed, bits=2),
        train("quant", args.steps, args.batch, args.seed, bits=4),
    ]
    for r in runs:
        ratio = r["saved_mb"] / r["packed_mb"] if r["packed_mb"] else 1.0
        print(
            f"{r['codec']:<6} test acc {r['acc']:.3f}  activations {r['saved_mb']:.2f} MB -> "
            f"{r['packed_mb'] or r['saved_mb']:.2f} MB ({ratio:.1f}x)"
        )


if __name__ == "__main__":
    main()
