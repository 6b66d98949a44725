"""Command line: `torchrun --nproc_per_node=N -m tpflash.train [--config NAME|FILE] [--key=value ...]`.

Also installed as the `tpflash-train` console script. `--print-config` prints the resolved
config and exits (no process group is created). See tpflash.train.config for the keys.

A mistake in the config, the layout or the inputs (ValueError, a missing file, a corrupt
checkpoint) prints one line, `error: <message>`, once per job rather than a traceback per rank,
and exits with status 2 on every rank. `--debug` or TPFLASH_DEBUG=1 shows the full traceback
instead. Any other exception is a bug and keeps its traceback.

A worker sent SIGUSR1 prints every thread's Python stack to its stderr and goes on (`kill -USR1
<pid>`, or `pkill -USR1 -f tpflash.train` for all of them): where a rank is, when a job seems stuck.
"""
from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from typing import Optional, Sequence

from ..checkpoint.integrity import CheckpointCorruptError

USAGE = """usage: torchrun --nproc_per_node=N -m tpflash.train [--config NAME|FILE] [--section.key=VALUE ...]
       tpflash-train ... (same arguments)

  --config NAME|FILE   a packaged config by name (demo, gpt2-small, gpt2-medium, gpt-1.3b, gpt-2.7b,
                       llama-style) or a YAML file; later --key=value override it
  --section.key=VALUE  e.g. --tp=2 --train.lr=3e-4 --model.n_layer=12 --checkpoint.dir=runs/x
  --key=VALUE          a bare key naming exactly one field (--lr=3e-4, --steps=100)
  --print-config       print the resolved config and exit
  --debug              full tracebacks for configuration and input errors (also TPFLASH_DEBUG=1)
"""

# Errors that mean "the job was asked for something wrong", not "tpflash has a bug": reported as
# one line. Everything else propagates with its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, CheckpointCorruptError)
USER_ERROR_STATUS = 2

# How long a rank other than 0 waits before reporting its own error line. Ranks usually fail
# together (inputs are checked on every rank before any collective), and then rank 0's line is
# the only one: torchrun stops the other workers as soon as rank 0 exits. The wait counts from this
# rank's own error, and on a loaded machine rank 0 may reach the same check (imports, reading the
# config) several seconds later, so it is generous. A rank whose error rank 0 does not share
# outlives the wait and reports it itself, so no error goes unreported; rank 0 would otherwise sit
# in its first collective until the timeout, so the wait costs nothing there.
OTHER_RANK_GRACE_S = 30.0

# Destroying the process groups takes well under a second; one that has not returned after this
# long never will (e.g. a communicator some CUDA graph still holds), and the worker exits without
# it rather than holding the job (the run's work is saved or has failed already by then).
SHUTDOWN_WAIT_S = 30.0


def _rank() -> int:
    """This process's global rank under torchrun (0 when launched directly)."""
    return int(os.environ.get("RANK", "0"))


def _report(error: BaseException) -> int:
    """Print `error: <message>` once per job; the exit status for a user error."""
    message = str(error) or type(error).__name__
    rank = _rank()
    if rank != 0:
        # Die quietly if torchrun stops this worker while it waits (the default SIGTERM action,
        # not the trainer's save-and-exit handler, which may still be installed).
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(OTHER_RANK_GRACE_S)
        message = f"(rank {rank}) {message}"
    print(f"error: {message}", file=sys.stderr, flush=True)
    return USER_ERROR_STATUS


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse arguments, train, optionally sample; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        try:
            sys.stdout.write(USAGE + "\n")
            sys.stdout.flush()
        except BrokenPipeError:  # e.g. `tpflash-train --help | head -1`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 0
    debug = "--debug" in argv or os.environ.get("TPFLASH_DEBUG", "0") not in ("", "0")
    print_only = "--print-config" in argv
    argv = [a for a in argv if a not in ("--print-config", "--debug")]
    try:
        return _run(argv, print_only)
    except USER_ERRORS as e:
        if debug:
            raise
        return _report(e)


def _last_words(finished: bool) -> Optional[str]:
    """On rank 0 of a failed run, the error main() reports after shutdown(), for shutdown to print if it
    must end the process before that (its groups' destruction hung)."""
    error = sys.exc_info()[1]
    if finished or error is None or _rank() != 0:
        return None
    if isinstance(error, USER_ERRORS):
        return f"error: {str(error) or type(error).__name__}"
    return "".join(traceback.format_exception(error))


def _run(argv: Sequence[str], print_only: bool) -> int:
    """main() without the error reporting."""
    from .config import parse_args, to_yaml
    cfg = parse_args(argv)
    if print_only:
        print(to_yaml(cfg), end="")
        return 0
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)  # stacks on demand (module docstring)
    from ..parallel import shutdown
    from .loop import Trainer
    trainer, finished = None, False
    try:
        trainer = Trainer(cfg)
        trainer.run()
        if cfg.log.sample_tokens > 0:
            text = trainer.sample(cfg.log.sample_prompt, cfg.log.sample_tokens)
            if trainer.is_main:
                print(f"--- sample ({cfg.log.sample_tokens} tokens after {cfg.log.sample_prompt!r}) ---\n{text}\n---",
                      flush=True)
        finished = True
    finally:
        if trainer is not None:
            trainer.close(wait_for_device=finished)  # after an error the device may wait on a peer that never comes
        trainer = None  # its model holds the process groups: shutdown() frees them while the interpreter is whole
        shutdown(exit_after_s=SHUTDOWN_WAIT_S, exit_status=0 if finished else 1, last_words=_last_words(finished))
    return 0


if __name__ == "__main__":
    sys.exit(main())
