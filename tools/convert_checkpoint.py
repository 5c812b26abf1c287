"""Convert checkpoints between Hugging Face (safetensors) and Megatron distributed (torch_dist) format.

    python tools/convert_checkpoint.py hf-to-mcore --hf DIR --out DIR --tp N --pp N [--vpp N] [--ep N]
                                                   [--dtype bfloat16] [--model-config model_configs/X.yaml]
    python tools/convert_checkpoint.py mcore-to-hf --ckpt DIR --out DIR [--tp N --pp N --ep N]

A Megatron checkpoint saved at one TP/PP/VPP/EP loads at any other (training, tools/score.py, mcore-to-hf). The
ranks (tp*pp, times the data-parallel ranks EP needs beyond tp) take a GPU each where the machine has enough, else
they all run on the CPU (gloo): --device cpu|cuda forces one; cuda with too few GPUs is refused.
Errors (missing file, unsupported architecture, config mismatch, existing output) are one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf_mc.bridge.convert import hf_to_mcore, mcore_to_hf  # noqa: E402
from rlhf_mc.config import ConfigError, ParallelConfig  # noqa: E402
from rlhf_mc.runtime.spawn import spawn_device  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF checkpoint -> Megatron distributed checkpoint")
    to_mcore.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    to_mcore.add_argument("--out", required=True)
    to_mcore.add_argument("--model-config", help="model_configs YAML to check the HF config against")
    to_mcore.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    to_hf = sub.add_parser("mcore-to-hf", help="Megatron distributed checkpoint -> HF checkpoint")
    to_hf.add_argument("--ckpt", required=True)
    to_hf.add_argument("--out", required=True)
    for p in (to_mcore, to_hf):
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--pp", type=int, default=1)
        p.add_argument("--vpp", type=int, default=1)
        p.add_argument("--ep", type=int, default=1, help="expert parallel (mixture-of-experts models)")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                       help="auto: a GPU per rank when there are enough, else the CPU")
    args = parser.parse_args(argv)
    try:
        parallel = ParallelConfig(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep)
        spawn_device(parallel.min_world_size, args.device)  # refuses cuda without a GPU per rank, up front
        if args.command == "hf-to-mcore":
            out = hf_to_mcore(args.hf, args.out, parallel, args.dtype, args.model_config, progress=not args.quiet,
                              device=args.device)
        else:
            out = mcore_to_hf(args.ckpt, args.out, parallel, progress=not args.quiet, device=args.device)
    except (ConfigError, FileNotFoundError, FileExistsError, KeyError, ValueError) as e:
        message = e.args[0] if isinstance(e, KeyError) else str(e)
        print(f"error: {message}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
