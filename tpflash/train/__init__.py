"""The training entry point (torchrun -m tpflash.train): config, data, loop, metrics, CLI.

Heavy pieces (the loop, which imports the models) load lazily, so `import tpflash` stays cheap.
"""
from .config import TrainConfig, load_yaml, parse_args

__all__ = ["TrainConfig", "Trainer", "load_yaml", "parse_args"]


def __getattr__(name):
    if name == "Trainer":
        from .loop import Trainer
        return Trainer
    raise AttributeError(name)
