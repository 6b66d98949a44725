"""Command line: `torchrun --nproc_per_node=N -m tpflash.train [--config FILE] [--key=value ...]`.

Also installed as the `tpflash-train` console script. `--print-config` prints the resolved
config and exits (no process group is created). See tpflash.train.config for the keys.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

USAGE = """usage: torchrun --nproc_per_node=N -m tpflash.train [--config FILE] [--section.key=VALUE ...]
       tpflash-train ... (same arguments)

  --config FILE        YAML config (configs/*.yaml); later --key=value override it
  --section.key=VALUE  e.g. --tp=2 --train.lr=3e-4 --model.n_layer=12 --checkpoint.dir=runs/x
  --key=VALUE          a bare key naming exactly one field (--lr=3e-4, --steps=100)
  --print-config       print the resolved config and exit
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse arguments, train, optionally sample; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    print_only = "--print-config" in argv
    argv = [a for a in argv if a != "--print-config"]
    from .config import parse_args, to_yaml
    try:
        cfg = parse_args(argv)
    except ValueError as e:
        print(f"tpflash.train: {e}", file=sys.stderr)
        return 2
    if print_only:
        print(to_yaml(cfg), end="")
        return 0
    from ..parallel import shutdown
    from .loop import Trainer
    trainer = Trainer(cfg)
    try:
        trainer.run()
        if cfg.log.sample_tokens > 0:
            text = trainer.sample(cfg.log.sample_prompt, cfg.log.sample_tokens)
            if trainer.is_main:
                print(f"--- sample ({cfg.log.sample_tokens} tokens after {cfg.log.sample_prompt!r}) ---\n{text}\n---",
                      flush=True)
    finally:
        del trainer  # its model holds the process groups: shutdown() frees them while the interpreter is whole
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
