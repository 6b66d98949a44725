"""`python -m tpflash.checkpoint consolidate DIR OUT.safetensors [--hf-dir HFDIR]`,
`python -m tpflash.checkpoint export-hf DIR OUT_DIR [--max-shard-size 5GB] [--tokenizer-from HF_DIR]` and
`python -m tpflash.checkpoint info DIR [--no-verify]` (CPU, single process)."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    """Command line of `python -m tpflash.checkpoint`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m tpflash.checkpoint", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    cons = commands.add_parser("consolidate", help="write one unsharded safetensors file from a checkpoint")
    cons.add_argument("dir", help="a checkpoint directory (step_N) or a checkpoint root (its latest is used)")
    cons.add_argument("out", help="output .safetensors file")
    cons.add_argument("--hf-dir", default=None, help="also write a Hugging Face model directory (GPT-2/Llama)")
    export = commands.add_parser("export-hf", help="write a Hugging Face model directory (sharded safetensors), "
                                                   "reading one tensor at a time")
    export.add_argument("dir", help="a checkpoint directory (step_N) or a checkpoint root (its latest is used)")
    export.add_argument("out", help="output directory")
    export.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB, 2GiB")
    export.add_argument("--tokenizer-from", default=None, help="a Hugging Face model directory whose tokenizer "
                                                               "files (and generation config) are copied")
    info = commands.add_parser("info", help="what a checkpoint holds; exit 1 if any of its files is damaged")
    info.add_argument("dir", help="a checkpoint directory (step_N) or a checkpoint root (its latest is used)")
    info.add_argument("--no-verify", action="store_true", help="check file sizes only, not their sha256")
    args = parser.parse_args(argv)
    if args.command == "info":
        from .info import describe, format_description
        from .integrity import CheckpointCorruptError
        try:
            print("\n".join(format_description(describe(args.dir, verify=not args.no_verify))))
        except (CheckpointCorruptError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    if args.command == "export-hf":
        from .export_hf import export_hf, output_files
        try:
            out = export_hf(args.dir, args.out, args.max_shard_size, args.tokenizer_from)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"wrote a Hugging Face model to {out}: {', '.join(output_files(out))}")
        return 0
    from .consolidate import consolidate
    tensors = consolidate(args.dir, args.out, args.hf_dir)
    numel = sum(t.numel() for t in tensors.values())
    print(f"wrote {len(tensors)} tensors ({numel:,} values) to {args.out}"
          + (f" and a Hugging Face model to {args.hf_dir}" if args.hf_dir else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
