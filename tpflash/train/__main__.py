"""`python -m tpflash.train` / `torchrun -m tpflash.train`: see tpflash.train.cli."""
import sys

from .cli import main

sys.exit(main())
