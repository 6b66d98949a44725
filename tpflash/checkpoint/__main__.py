"""`python -m tpflash.checkpoint consolidate DIR OUT.safetensors [--hf-dir HFDIR]` (CPU, single process)."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpflash.checkpoint", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    cons = commands.add_parser("consolidate", help="write one unsharded safetensors file from a checkpoint")
    cons.add_argument("dir", help="a checkpoint directory (step_N) or a checkpoint root (its latest is used)")
    cons.add_argument("out", help="output .safetensors file")
    cons.add_argument("--hf-dir", default=None, help="also write a Hugging Face model directory (GPT-2/Llama)")
    args = parser.parse_args(argv)
    from .consolidate import consolidate
    tensors = consolidate(args.dir, args.out, args.hf_dir)
    numel = sum(t.numel() for t in tensors.values())
    print(f"wrote {len(tensors)} tensors ({numel:,} values) to {args.out}"
          + (f" and a Hugging Face model to {args.hf_dir}" if args.hf_dir else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
