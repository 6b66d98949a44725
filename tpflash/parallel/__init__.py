"""Parallel state, collectives and sharding metadata (used by every layer above the kernels)."""
from . import comm
from .fsdp import apply_fsdp, block_wrap_policy, size_wrap_policy
from .local_adamw import LocalShardAdamW
from .parallelize import parallelize
from .replicate import replicate_over_dp
from .sharding import ShardSpec, full_state_dict, load_full_state_dict
from .zero import ShardedOptimizerState
from .zero3 import ShardedBlocks, materialize_outside_blocks, shard_blocks
from .state import (NO_GROUP, ParallelState, check_layout, get_default_state, init, resolve_cp_group,
                    resolve_tp_group, set_default_state, shutdown)

__all__ = ["LocalShardAdamW", "NO_GROUP", "ParallelState", "ShardSpec", "apply_fsdp", "block_wrap_policy", "check_layout", "comm",
           "full_state_dict", "get_default_state", "init", "load_full_state_dict", "materialize_outside_blocks", "parallelize",
           "replicate_over_dp", "ShardedBlocks", "ShardedOptimizerState", "resolve_cp_group", "resolve_tp_group", "set_default_state", "shutdown",
           "shard_blocks", "size_wrap_policy"]
