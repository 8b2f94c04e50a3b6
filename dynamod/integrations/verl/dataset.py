"""A tiny GSM8K-shaped parquet dataset, built locally, for verl runs on CPU.

verl's `RLHFDataset` reads rows of `data_source`, `prompt` (chat messages), `ability`,
`reward_model` ({"style": "rule", "ground_truth": ...}) and `extra_info`; with
`data_source = "openai/gsm8k"` verl's default reward scores a response by the number
after `####`. The questions are small sums, so nothing is downloaded.

    python -m dynamod.integrations.verl.dataset OUT_DIR [--train N] [--val N]

writes OUT_DIR/train.parquet and OUT_DIR/val.parquet and prints their paths.
"""

from __future__ import annotations

import argparse
import importlib
import random
import sys
from pathlib import Path
from typing import Any

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def rows(count: int, seed: int, split: str) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for index in range(count):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"What is {a} plus {b}? {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": index},
        })
    return out


def write(out_dir: Path, train: int = 16, val: int = 4) -> tuple[Path, Path]:
    """Write train.parquet and val.parquet under `out_dir`; returns their paths."""
    pd: Any = importlib.import_module("pandas")  # verl's dependency; untyped

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "train.parquet", out_dir / "val.parquet"
    for path, count, seed, split in ((paths[0], train, 1, "train"), (paths[1], val, 2, "test")):
        pd.DataFrame(rows(count, seed, split)).to_parquet(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--train", type=int, default=16)
    parser.add_argument("--val", type=int, default=4)
    args = parser.parse_args(argv)
    for path in write(args.out_dir, args.train, args.val):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
