"""What generated code calls. Every function here is a plain, differentiable Python call."""

from dpcompile.runtime import nested_encoder  # noqa: F401 - registers the op dpcompile::encoder_nested_path
from dpcompile.runtime.batch_values import (
    batch_arange,
    local_positions,
    rows_of_shard,
    running_sum,
    squeeze_except,
    write_back,
    written,
)
from dpcompile.runtime.batchnorm import batch_norm, functional_batch_norm
from dpcompile.runtime.comm import TAKE_FIRST, broadcast, gather, scatter, split_sizes, to_device
from dpcompile.runtime.grad import grad_over_devices, without_grad
from dpcompile.runtime.hooks import run_forward_hook
from dpcompile.runtime.pipeline import partial_pair, send
from dpcompile.runtime.random import (
    RandomDraws,
    exact_attention,
    exact_bernoulli,
    exact_dropout,
    exact_dropout_module,
    exact_fill_random,
    exact_native_dropout,
    exact_random_like,
    random_draws,
    random_draws_over_ranks,
)
from dpcompile.runtime.random_more import (
    exact_multinomial,
    exact_normal,
    exact_normal_size,
    exact_poisson,
    exact_special_dropout,
    exact_special_dropout_module,
    exact_stochastic_depth,
    exact_written_fill,
    stochastic_depth,
)
from dpcompile.runtime.random_plan import current_random_draws
from dpcompile.runtime.random_scope import exact_random_scope
from dpcompile.runtime.recompute import checkpoint, join_tiles, keep_outputs, token_tiles
from dpcompile.runtime.reduce import max_length, mean_of_partials, numel, numel_over, reduce_add, target_weight
from dpcompile.runtime.replicate import ModuleView, ReplicaRoot, ReplicaSet, module_of, refresh_replicas, replicate
from dpcompile.runtime.rnn import flatten_parameters, weights_in_one_buffer
from dpcompile.runtime.sequence import (
    attention_regathered,
    causal_attention,
    gather_sequence,
    sequence_split,
    sequence_whole,
)
from dpcompile.runtime.sequence_all_to_all import heads_of_sequence, heads_share, sequence_of_heads
from dpcompile.runtime.sequence_balance import balanced_attention, balanced_rows_back
from dpcompile.runtime.sequence_ring import ring_attention
from dpcompile.runtime.side_effects import (
    apply_function,
    assign_buffer,
    attributes_written,
    in_place_without_grad,
)

__all__ = [
    "ModuleView",
    "RandomDraws",
    "exact_attention",
    "exact_bernoulli",
    "exact_dropout",
    "exact_dropout_module",
    "exact_fill_random",
    "exact_native_dropout",
    "exact_random_like",
    "random_draws",
    "current_random_draws",
    "exact_random_scope",
    "exact_multinomial",
    "exact_normal",
    "exact_normal_size",
    "exact_poisson",
    "exact_written_fill",
    "exact_special_dropout",
    "exact_stochastic_depth",
    "stochastic_depth",
    "exact_special_dropout_module",
    "random_draws_over_ranks",
    "ReplicaRoot",
    "ReplicaSet",
    "TAKE_FIRST",
    "apply_function",
    "attention_regathered",
    "balanced_attention",
    "balanced_rows_back",
    "assign_buffer",
    "attributes_written",
    "batch_arange",
    "batch_norm",
    "functional_batch_norm",
    "broadcast",
    "causal_attention",
    "checkpoint",
    "flatten_parameters",
    "keep_outputs",
    "gather",
    "gather_sequence",
    "heads_of_sequence",
    "heads_share",
    "sequence_of_heads",
    "in_place_without_grad",
    "join_tiles",
    "local_positions",
    "max_length",
    "mean_of_partials",
    "module_of",
    "numel",
    "numel_over",
    "partial_pair",
    "reduce_add",
    "refresh_replicas",
    "replicate",
    "ring_attention",
    "rows_of_shard",
    "running_sum",
    "run_forward_hook",
    "scatter",
    "sequence_split",
    "sequence_whole",
    "send",
    "split_sizes",
    "squeeze_except",
    "target_weight",
    "to_device",
    "token_tiles",
    "weights_in_one_buffer",
    "without_grad",
    "grad_over_devices",
    "write_back",
    "written",
]


def _present_as_runtime() -> None:
    """Generated code names these functions ``dpcompile_runtime_<name>`` and pickles them by
    this module's path, whichever file defines them."""
    for name in __all__:
        obj = globals()[name]
        if callable(obj) and getattr(obj, "__module__", "").startswith(__name__ + "."):
            obj.__module__ = __name__


_present_as_runtime()
