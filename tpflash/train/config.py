"""The training configuration: dataclasses, loaded from YAML and overridden from the command line.

A config has top-level keys (tp, dp, cp, cp_comm, seed, dtype, fsdp, cuda_graphs, gemm_workspace) and sections: `model` (a preset name
or a Hugging Face model directory in `init_from`, and/or GPTConfig fields), `data`, `train` (optimisation and batch sizes),
`checkpoint`, `log` and `dist` (how long a rank waits for the others).
YAML mirrors that nesting. Command-line overrides are `--section.key=value` (or
`--section.key value`); a bare `--key=value` is accepted when the key names exactly one field
(`--lr=3e-4` means `--train.lr=3e-4`; `--dir` is ambiguous and says so). Values are converted
to the field's type; unknown keys raise ValueError naming the key and the valid ones.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import yaml

from .. import configs as packaged_configs
from ..kernels.gemm_workspace import CHOICES as GEMM_WORKSPACE_CHOICES


def _model_keys() -> tuple:
    """"preset", "init_from" and GPTConfig's fields (a fixed list when tpflash.models cannot be imported)."""
    try:
        from ..models.config import GPTConfig
        return ("preset", "init_from") + tuple(f.name for f in dataclasses.fields(GPTConfig))
    except ImportError:
        return ("preset", "init_from", "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_kv_head", "ffn_hidden",
                "mlp", "norm", "position", "tie_embeddings", "bias", "dropout", "norm_eps", "rope_theta",
                "sequence_parallel", "activation_checkpointing", "fused_loss", "init_std", "seed")


MODEL_KEYS = _model_keys()  # `preset` picks GPTConfig.preset(name), `init_from` a Hugging Face model directory
# (its config, and its weights at step 0); the other keys replace their fields


@dataclass
class DataConfig:
    """Where tokens come from. `path`: files, directories or globs (text), or one token file.

    format: "text" (files read as UTF-8 bytes, tokenized), "uint16"/"uint32" (a flat np.memmap of
    token ids), "jsonl" (fine-tuning examples, prompt/completion or chat messages: docs/finetuning.md),
    or "auto" (.bin/.u16 -> uint16, .u32 -> uint32, a single .jsonl file -> jsonl, else text).
    `path: "@stdlib"` means the Python standard library's source directory. tokenizer: "byte"
    (built in, 256 ids) or a Hugging Face tokenizer name/path available locally. seq_len 0 means
    model.block_size. pack (jsonl only): several examples per row (else one, padded).
    """

    path: List[str] = field(default_factory=list)
    format: str = "auto"
    include: List[str] = field(default_factory=lambda: ["*"])
    exclude: List[str] = field(default_factory=list)
    max_bytes: int = 0
    tokenizer: str = "byte"
    seq_len: int = 0
    eval_fraction: float = 0.05
    pack: bool = True


@dataclass
class TrainSection:
    """Optimisation. batch_size is the global batch in sequences; each dp rank runs
    grad_accum micro-batches of micro_batch_size (grad_accum 0 = batch_size / (micro * dp))."""

    steps: int = 1000
    batch_size: int = 8
    micro_batch_size: int = 0  # 0: batch_size / dp (no accumulation)
    grad_accum: int = 0
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 100
    decay_steps: int = 0  # cosine length after warmup; 0: steps - warmup_steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip: float = 1.0  # global grad-norm clip; 0 disables
    fused_adam: str = "auto"  # auto: fused on CUDA
    eval_interval: int = 0  # 0: only at the end
    eval_batches: int = 4


@dataclass
class CheckpointSection:
    """Sharded checkpoints (tpflash.checkpoint) under `dir`; resume from dir/latest when present."""

    dir: str = ""
    interval: int = 0  # 0: only at the end
    keep: int = 3  # the newest `keep` checkpoints stay; 0 keeps every one
    resume: bool = True
    async_save: bool = False  # periodic saves return once tensors are in host memory (the last one waits)
    direct_io: bool = True  # files written with O_DIRECT where the filesystem takes it; false: the page cache
    export_hf: str = ""  # at the end of training, a Hugging Face model directory here (tpflash.models.save_pretrained)
    on_corrupt: str = "fallback"  # newest step fails verification at resume: fallback (to the step before) | error
    # model config fields a resumed run may set to other values than the checkpoint's (tpflash.train.resume_config)
    allow_config_change: List[str] = field(default_factory=list)


@dataclass
class LogSection:
    """Where metrics go: stdout (progress bar or lines), dir/metrics.jsonl, dir/tb (when installed)."""

    dir: str = ""
    interval: int = 10
    progress: str = "auto"  # auto | bar | lines | none
    tensorboard: str = "auto"
    peak_flops: float = 0.0  # per device; 0: 989e12 on CUDA (H100 bf16 dense), none on CPU
    sample_tokens: int = 0  # after training, generate this many tokens from sample_prompt
    sample_prompt: str = "def "
    trace: str = ""  # START:END: torch.profiler trace of those steps, per rank, in dir/trace/ (tpflash.train.trace)


@dataclass
class DistSection:
    """Timeouts, in seconds, of the waits between ranks (tpflash.train.watchdog): a rank that waits for the
    others longer than this fails the job with one line naming the rank that did not arrive."""

    timeout: float = 600.0  # every step after the first
    long_timeout: float = 0.0  # start-up, the first step, evaluations, checkpoint saves; 0: 3 x timeout

    @property
    def long(self) -> float:
        """long_timeout, or 3 x timeout when it is 0."""
        return self.long_timeout or 3 * self.timeout


@dataclass
class TrainConfig:
    """Everything `python -m tpflash.train` needs. dtype: "auto" (bf16 autocast on CUDA, fp32 on
    CPU), "bf16" or "fp32". fsdp: how the dp ranks hold the model: "off" (replicated,
    DDP), "zero1" (AdamW's state sharded over dp, parameters replicated: tpflash.parallel.zero), "zero3"
    (the blocks' weights sharded too, gathered into static buffers that CUDA graphs replay on:
    tpflash.parallel.zero3), "on" (FSDP2) or "auto" (at dp > 1: zero3 on CUDA with graphed blocks, elsewhere
    zero1 where it fits in half the device, else FSDP: tpflash.train.build.fsdp_choice). cuda_graphs:
    "auto" (replay the model's blocks as CUDA graphs on CUDA at tp > 1, and at tp=1 with dp=1, when
    the model allows it: no FSDP, dropout 0; activation checkpointing is recomputed inside the graphs), "on" (also at tp=1 with
    dp > 1; an error if not allowed), "off". The world is dp * cp * tp ranks; cp > 1 splits every
    sequence over cp ranks (attention through "ring" or "allgather" cp_comm) and needs unpacked data.
    gemm_workspace: cuBLAS's scratch memory, "auto" (none at tp > 1: no memset before each GEMM),
    "default" or "none" (tpflash.kernels.gemm_workspace; CUBLAS_WORKSPACE_CONFIG, where set, is kept)."""

    tp: int = 1
    dp: int = -1
    cp: int = 1  # context parallelism: ranks that share each sequence (docs/context_parallel.md)
    cp_comm: str = "ring"  # ring | allgather: how those ranks exchange keys and values
    seed: int = 1234
    dtype: str = "auto"
    fsdp: str = "auto"
    cuda_graphs: str = "auto"
    gemm_workspace: str = "auto"
    model: Dict[str, Any] = field(default_factory=dict)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)
    dist: DistSection = field(default_factory=DistSection)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f for f in dataclasses.fields(TrainConfig) if dataclasses.is_dataclass(f.default_factory)}
_CHOICES = {"dtype": ("auto", "bf16", "fp32"), "cp_comm": ("ring", "allgather"), "fsdp": ("auto", "off", "zero1", "zero3", "on"), "cuda_graphs": ("auto", "on", "off"),
            "gemm_workspace": GEMM_WORKSPACE_CHOICES,
            "data.format": ("auto", "text", "uint16", "uint32", "jsonl"), "train.fused_adam": ("auto", "on", "off"),
            "log.progress": ("auto", "bar", "lines", "none"), "log.tensorboard": ("auto", "on", "off"),
            "checkpoint.on_corrupt": ("fallback", "error")}


def _unknown(key: str, valid: Sequence[str]) -> ValueError:
    leaves = {k.rsplit(".", 1)[-1]: k for k in valid}
    close = difflib.get_close_matches(key, valid, n=3) or [leaves[k] for k in difflib.get_close_matches(key, leaves, n=3)]
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return ValueError(f"unknown config key {key!r}{hint}; valid keys: {', '.join(sorted(valid))}")


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """`value` (from YAML or a command-line string) as the field's type."""
    hint = typing.get_origin(annotation) or annotation
    try:
        if hint is bool:
            if isinstance(value, str):
                low = value.strip().lower()
                if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError
                return low in ("true", "1", "yes", "on")
            return bool(value)
        if hint is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
        if hint is float:
            return float(value)
        if hint is str:
            if isinstance(value, bool) and "on" in _CHOICES.get(key, ()):
                value = "on" if value else "off"  # YAML 1.1 reads on/off as booleans
            return "" if value is None else str(value).lower() if key in _CHOICES else str(value)
        if hint in (list, List):
            if isinstance(value, str):
                parsed = yaml.safe_load(value) if value.startswith("[") else [v for v in value.split(",") if v]
                return [str(v) for v in parsed]
            return [str(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    except (TypeError, ValueError):
        raise ValueError(f"config key {key!r}: cannot read {value!r} as {getattr(hint, '__name__', hint)}") from None
    return value


def _scalar(text: str) -> Any:
    """A command-line value for a model field: int, float, bool or string."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return yaml.safe_load(text)


def _all_keys() -> List[str]:
    keys = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in SECTIONS and f.name != "model"]
    keys += [f"model.{k}" for k in MODEL_KEYS]
    for name, f in SECTIONS.items():
        keys += [f"{name}.{g.name}" for g in dataclasses.fields(f.default_factory)]
    return keys


def _resolve_key(key: str) -> str:
    """The full dotted key for `key` (dotted, or a bare leaf naming one field)."""
    valid = _all_keys()
    if key in valid:
        return key
    matches = [k for k in valid if k.rsplit(".", 1)[-1] == key]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise ValueError(f"config key {key!r} is ambiguous: write one of {', '.join(matches)}")
    raise _unknown(key, valid)


def set_value(cfg: TrainConfig, key: str, value: Any) -> None:
    """Set one key (dotted or unique bare name) on `cfg`, converting `value` to the field's type."""
    full = _resolve_key(key)
    hints = typing.get_type_hints(TrainConfig)
    if "." not in full:
        setattr(cfg, full, _checked(full, _coerce(value, hints[full], full)))
        return
    section, leaf = full.split(".", 1)
    if section == "model":
        cfg.model[leaf] = _scalar(value) if isinstance(value, str) and leaf != "preset" else value
        return
    target = getattr(cfg, section)
    hint = typing.get_type_hints(type(target))[leaf]
    setattr(target, leaf, _checked(full, _coerce(value, hint, full)))


def _at_least(low):
    return (lambda v: v >= low), f"must be >= {low}"


_POSITIVE = ((lambda v: v > 0), "must be > 0")
_FRACTION = ((lambda v: 0 <= v < 1), "must be in [0, 1)")
# numeric fields whose values outside these ranges would train nonsense silently (steps=-3 runs no
# step) or fail deep inside torch; tp, cp and dp are checked against the world size by check_layout
_RANGES = {
    "train.steps": _at_least(0), "train.batch_size": _at_least(1), "train.micro_batch_size": _at_least(0),
    "train.grad_accum": _at_least(0), "train.lr": _POSITIVE, "train.min_lr": _at_least(0),
    "train.warmup_steps": _at_least(0), "train.decay_steps": _at_least(0), "train.weight_decay": _at_least(0),
    "train.beta1": _FRACTION, "train.beta2": _FRACTION, "train.eps": _POSITIVE, "train.clip": _at_least(0),
    "train.eval_interval": _at_least(0), "train.eval_batches": _at_least(0),
    "data.max_bytes": _at_least(0), "data.seq_len": _at_least(0), "data.eval_fraction": _FRACTION,
    "checkpoint.interval": _at_least(0), "checkpoint.keep": _at_least(0),
    "log.interval": _at_least(1), "log.peak_flops": _at_least(0), "log.sample_tokens": _at_least(0),
    "dist.timeout": _POSITIVE, "dist.long_timeout": _at_least(0),
}


def _checked(key: str, value: Any) -> Any:
    """`value` if it is allowed for `key` (one of its choices, inside its range), else ValueError."""
    choices = _CHOICES.get(key)
    if choices and value not in choices:
        raise ValueError(f"config key {key!r}: {value!r} is not one of {', '.join(choices)}")
    if key in _RANGES:
        allowed, rule = _RANGES[key]
        if not allowed(value):
            raise ValueError(f"config key {key!r}: {value!r} {rule}")
    return value


def check_values(cfg: TrainConfig) -> None:
    """Apply the choice and range rules to every field of `cfg`, for configs built in code rather
    than through set_value (which checks each key as it is set)."""
    for key in list(_CHOICES) + list(_RANGES):
        section, _, leaf = key.rpartition(".")
        _checked(key, getattr(getattr(cfg, section) if section else cfg, leaf))
    if 0 < cfg.dist.long_timeout < cfg.dist.timeout:
        raise ValueError(f"config key 'dist.long_timeout': {cfg.dist.long_timeout!r} must be 0 (3 x dist.timeout) "
                         f"or >= dist.timeout ({cfg.dist.timeout!r})")


def _flatten(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out = {}
    for key, value in tree.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict) and (full in SECTIONS or full == "model"):
            if full == "model":
                out.update({f"model.{k}": v for k, v in value.items()})
            else:
                out.update(_flatten(value, f"{full}."))
        else:
            out[full] = value
    return out


def from_dict(tree: Dict[str, Any], cfg: Optional[TrainConfig] = None) -> TrainConfig:
    """A config from a nested dict (as YAML gives); keys must be full (section.key) names."""
    cfg = cfg or TrainConfig()
    valid = _all_keys()
    for key, value in _flatten(tree or {}).items():
        if key not in valid:
            raise _unknown(key, valid)
        set_value(cfg, key, value)
    return cfg


def load_yaml(path: str, cfg: Optional[TrainConfig] = None) -> TrainConfig:
    """Read a YAML config file (nested sections) into a TrainConfig."""
    with open(path) as f:
        tree = yaml.safe_load(f) or {}
    if not isinstance(tree, dict):
        raise ValueError(f"{path}: a config file must be a mapping of keys, got {type(tree).__name__}")
    try:
        return from_dict(tree, cfg)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def resolve_config(value: str) -> str:
    """The YAML file that `--config VALUE` names: an existing file, else a packaged config's name.

    "demo" (or "demo.yaml") is tpflash/configs/demo.yaml, wherever the command runs; a path to a
    file that exists always wins. Anything else is a ValueError listing the packaged names.
    """
    if os.path.isfile(value):
        return value
    packaged = packaged_configs.find(value)
    if packaged is not None:
        return str(packaged)
    raise ValueError(f"--config {value!r}: no such file, and not a packaged config "
                     f"(packaged: {', '.join(packaged_configs.names())})")


def parse_args(argv: Sequence[str]) -> TrainConfig:
    """`[--config FILE|NAME] [--key=value | --key value ...]`: the file first, then overrides in order."""
    pairs, config_path, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}: expected --key=value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ValueError(f"{arg} needs a value (--{key}=VALUE)")
            value, i = argv[i + 1], i + 1
        key = key.replace("-", "_")
        if key == "config":
            config_path = value
        else:
            pairs.append((key, value))
        i += 1
    cfg = load_yaml(resolve_config(config_path)) if config_path else TrainConfig()
    for key, value in pairs:
        set_value(cfg, key, value)
    return cfg


def to_yaml(cfg: TrainConfig) -> str:
    """The resolved config as YAML (logged at start and saved beside the checkpoints)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
