"""Turns GSM8K-style data (question / answer with a final "#### <number>") into the recipes' prompt format: parquet
files with "prompt" (the question plus an instruction to end with "#### <answer>") and "answer" (the number).

    python tools/prepare_data.py gsm8k --out data/gsm8k                    # from the HF hub (needs network)
    python tools/prepare_data.py gsm8k --out data/gsm8k --input train.jsonl --input test.jsonl   # local files

Local inputs (jsonl or parquet) keep their file stem as the split name.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf_mc.config import ConfigError  # noqa: E402
from rlhf_mc.data.dataset import read_rows  # noqa: E402

INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
SOURCES = {"gsm8k": ("openai/gsm8k", "main", ("train", "test"))}


def convert(row: dict, index: int, where: str) -> dict:
    for key in ("question", "answer"):
        if key not in row:
            raise ConfigError(f"{where}: row {index} has no key {key!r} (keys: {sorted(row)})")
    if "####" not in row["answer"]:
        raise ConfigError(f"{where}: row {index}: the answer has no final '#### <answer>'")
    final = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
    return {"prompt": f"{row['question'].strip()} {INSTRUCTION}", "answer": final, "solution": row["answer"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset", choices=sorted(SOURCES))
    parser.add_argument("--out", required=True)
    parser.add_argument("--input", action="append", default=[], help="local jsonl/parquet file (repeatable)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        if args.input:
            splits = {Path(p).stem: read_rows(p) for p in args.input}
        else:
            from datasets import load_dataset

            name, config, names = SOURCES[args.dataset]
            splits = {split: list(load_dataset(name, config, split=split)) for split in names}
        converted = {split: [convert(r, i, split) for i, r in enumerate(rows)] for split, rows in splits.items()}
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    for split, rows in converted.items():
        tmp = out / f".{split}.parquet.tmp"
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        tmp.rename(out / f"{split}.parquet")
        print(f"wrote {out / f'{split}.parquet'}: {len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
