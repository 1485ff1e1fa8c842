"""Why an op runs whole where a split of its rows exists: one table, :data:`WHOLE_REASONS`, keyed
by the op's name as OpInfo spells it (``torch.<name>`` without ``torch.``: ``"linalg.lstsq"``,
``"nn.functional.linear_cross_entropy"``; a variant as ``"addmm.decomposed"``).

The OpInfo proof (``benchmarks/opinfo_split.py``) asks, for every sample, whether a split on the
sample's dim 0 exists; an op whose rule keeps such a sample whole must have its reason here, or
the proof fails naming it. Each reason says what the op does that a split cannot reproduce (or,
for a sample the rule could split but does not, which case it refuses).

An op here without any batch rule gets one that runs it whole with this reason (what
``dpcompile.explain`` and the coverage page show), for ``torch.<name>`` and ``x.<name>()``.
"""

from __future__ import annotations

import torch

from dpcompile.analysis.batch_rules.context import Rule, RuleContext
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.placement import Placement, Whole

_ORDER = "a max, min or product over devices is not a partial dpcompile combines (only sums and means)"
_UNBATCHED = ("the sample is one unbatched input ((C, L) / (C, H, W)): its dim 0 is channels, which the rule does not "
              "take for a batch (a batched call splits)")  # fmt: skip
_GLOBAL_INDICES = "indices into the whole (flattened) tensor: a chunk's positions start at 0, not at its offset"
_COUNT = "a data-dependent count over the whole tensor: each chunk would find its own"
_NO_OP = "a no-op on a real tensor: the captured graph returns its input, there is no op to split"

WHOLE_REASONS: dict[str, str] = {
    # ---- over the batch dim, or every dim
    "prod": f"prod over the batch dim (or every dim): {_ORDER}",
    "masked.prod": f"masked.prod over the batch dim (or every dim): {_ORDER}",
    "masked.amax": f"masked.amax over the batch dim (or every dim): {_ORDER}",
    "masked.amin": f"masked.amin over the batch dim (or every dim): {_ORDER}",
    "masked.logsumexp": "masked.logsumexp over the batch dim (or every dim): a log-sum-exp of partials is no partial "
                        "dpcompile combines",
    "masked.mean": "masked.mean over the batch dim (or every dim): divides by the count of unmasked elements, which "
                   "differs by chunk (the partial mean counts rows)",
    "masked.norm": "masked.norm over the batch dim (or every dim): a p-norm of partial norms is no partial dpcompile "
                   "combines",
    "aminmax": f"aminmax over the batch dim (or every dim): {_ORDER}",
    "nanmean": "nanmean over the batch dim: NaNs are skipped, so each chunk's count differs (the partial mean counts "
               "rows)",
    "roll": "roll along dim 0 (the batch): rows rotate across devices (the sample's shift is 0, a no-op the rule does "
            "not special-case)",
    "diff": "diff along dim 0 (the batch): differences of neighbouring rows cross chunk borders (the sample's n=0 is a "
            "no-op the rule does not special-case)",
    "flip": "flips dim 0: the rows come back in reverse, across devices",
    "flipud": "flips dim 0: the rows come back in reverse, across devices",
    "squeeze": "squeeze(dims) naming the batch dim: a no-op on the whole (its size is not 1), but a device holding "
               "one row would drop that dim",
    "squeeze_copy": "squeeze_copy(dims) naming the batch dim: a no-op on the whole, but a device holding one row "
                    "would drop that dim",
    # ---- indices, counts and values over the whole tensor
    "nonzero": _COUNT + " (and its row indices start at 0 per chunk)",
    "nonzero_static": "indices of the whole tensor's nonzeros, padded to a fixed size: each chunk would pad its own",
    "argwhere": _COUNT + " (and its row indices start at 0 per chunk)",
    "masked_select": _COUNT + ", flattened",
    "unique": "the distinct values of the whole tensor, sorted: a data-dependent count, values from every row",
    "unique_consecutive": "runs of equal values of the whole tensor: a run may cross a chunk border",
    "histc": "a histogram of every element; with min=max=0 its range is read from the whole tensor's data",
    "histogram": "a histogram of every element (a range from the data, or a density normalised over the whole)",
    "histogramdd": "a histogram of every point (a range from the data, or a density normalised over the whole)",
    "take": _GLOBAL_INDICES,
    "put": _GLOBAL_INDICES + " (it writes there)",
    "index_add": "writes rows of the whole tensor at row numbers the index gives (global row numbers)",
    "index_copy": "writes rows of the whole tensor at row numbers the index gives (global row numbers)",
    "index_fill": "writes rows of the whole tensor at row numbers the index gives (global row numbers)",
    **dict.fromkeys([f"index_reduce.{k}" for k in ("amax", "amin", "mean", "prod")],
                    "reduces into rows of the whole tensor at row numbers the index gives (global row numbers)"),
    "kthvalue": "kthvalue along the batch dim (the sample's dim 0): the k-th value of the whole column",
    "mode": "mode along the batch dim (the sample's dim 0): the most frequent value of the whole column",
    "isin": "isin(x, test) with the test set split with x (it has x's rows): every element is tested against all of it",
    "combinations": "pairs of elements of the whole 1-D input: an output row mixes elements of different chunks",
    "meshgrid.variadic_tensors": "a grid of every pair of elements of its inputs: each output holds every row",
    "kron": "kron(a, b) interleaves rows: output row i * rows(b) + j mixes a's row i with b's row j",
    "hash_tensor": "a hash of every element (dim=()), the batch's rows among them",
    # ---- memory, strides and layout
    "as_strided": "strides address the whole tensor's memory",
    "as_strided.partial_views": "strides address the whole tensor's memory",
    "as_strided_copy": "strides address the whole tensor's memory",
    "as_strided_scatter": "strides address the whole tensor's memory",
    "slice_scatter": "the sample writes the source into the batch dim's rows (a slice of global row numbers)",
    "view_as_complex": "the sample is (rows, 2): its last dim (the real and imaginary parts) is the batch dim's "
                       "neighbour; a split leaves no leading dim to keep",
    # ---- backward and raw kernels
    "_softmax_backward_data": "a backward op: dpcompile differentiates the forward program, it captures no backward "
                              "graphs",
    "_native_batch_norm_legit": "the raw batch-norm kernel: with training=True its statistics are the whole batch's "
                                "(fx records F.batch_norm or the module, which are ruled)",
    "native_batch_norm": "the raw batch-norm kernel: with training=True its statistics are the whole batch's "
                         "(fx records F.batch_norm or the module, which are ruled)",
    # ---- samples that are one unbatched input
    **dict.fromkeys(["nn.functional.adaptive_avg_pool1d", "nn.functional.adaptive_avg_pool2d",
                     "nn.functional.adaptive_max_pool2d", "nn.functional.adaptive_max_pool3d",
                     "nn.functional.instance_norm"], _UNBATCHED),
    # ---- samples a rule refuses on purpose
    "addmm": "addmm(M, x, w) with M split by rows along x: the rule takes M for an unbatched bias (the sample's "
             "inner dim is 0, the product empty)",
    "addmm.decomposed": "addmm(M, x, w) with M split by rows along x: the rule takes M for an unbatched bias (the "
                        "sample's inner dim is 0, the product empty)",
    "cdist": "x2 has an empty leading batch (0, n, d): x1 of shape (n, d) is one set of points, not a batch",
    "matmul": "the 2-D left operand is one matrix (its dim 0 a row of it) against a batch of matrices; or the right "
              "operand is (1, n, m), broadcast along the batch, which the rule does not take for unbatched",
    "diag_embed": "dim1/dim2 given: the rule takes only the default (-2, -1), where the leading dims stay in front",
    "cross": "cross with dim=None: the first dim of size 3, which may be the batch dim",
    "fft.fftshift": "shifts every dim (dim=None), the batch dim among them: rows rotate across devices",
    "fft.ifftshift": "shifts every dim (dim=None), the batch dim among them: rows rotate across devices",
    "nn.functional.triplet_margin_loss": "reduction='mean' averages one loss per sample: the partial mean counts "
                                         "elements, not rows",
    "nn.functional.multilabel_soft_margin_loss": "reduction='mean' averages one loss per sample: the partial mean "
                                                 "counts elements, not rows",
    "nn.functional.multilabel_margin_loss": "reduction='mean' averages one loss per sample: the partial mean counts "
                                            "elements, not rows",
    **dict.fromkeys(["nn.functional.linear_cross_entropy", "nn.functional.linear_cross_entropy.chunked",
                     "nn.functional.linear_cross_entropy.chunked_none"],
                    "a fused linear and cross entropy whose options object (chunking) generated code cannot spell; its "
                    "mean divides by the whole batch's target weights"),
    # ---- more samples a rule refuses on purpose
    "nn.functional.gaussian_nll_loss": "var (or target) passed unsplit but as long as the batch: a var of shape "
                                       "input.shape[:-1] is one per sample, which the rule cannot tell from an "
                                       "unbatched one, so it runs whole",
    "rot90": "rot90 turning the plane of dims (0, 1) (the default), the batch dim among them: rows become columns",
    "tile": "tile repeating the batch dim (its rep is not 1): the copies of the rows follow each other, not each row",
    "unflatten": "unflattens dim 0 (the batch) into several dims: a chunk's rows regroup",
    "__rmatmul__": "other @ x with x a batch of matrices (or a 2-D x whose dim 0 is contracted): the matmul rules "
                   "read x as the left operand, which it is not here",
    "linalg.norm": "a matrix or vector norm over the batch dim (or every dim): a p-norm of partial norms is no "
                   "partial dpcompile combines",
    "linalg.vector_norm": "a vector norm over the batch dim (or every dim): a p-norm of partial norms is no partial "
                          "dpcompile combines",
    "norm": "a norm over the batch dim (or every dim): a p-norm of partial norms is no partial dpcompile combines",
    "linalg.norm.subgradients_at_zero": "a norm over the batch dim (or every dim): a p-norm of partial norms is no "
                                        "partial dpcompile combines",
    "linalg.lstsq": "lstsq's residuals, rank and singular values are empty for some drivers and shapes: not every "
                    "output has the stack's leading dims",
    "linalg.diagonal": "dim1/dim2 given: the rule takes only the default (-2, -1), where the leading dims stay in front",
    # ---- found by the gap slice: samples a rule refuses, and ops with no rule written yet
    "stft": "no rule written yet: stft frames each row of a 2-D (batch, time) input (per sample), but a 1-D "
            "input is one signal whose dim 0 is time",
    "tensor_split": "indices_or_sections given as a tensor, a value the rule cannot read from shapes",
    "hsplit": "no rule written yet: hsplit cuts dim 1 into pieces (per sample for 2-D and more), but dim 0 of a "
              "1-D input",
    "dsplit": "no rule written yet: dsplit cuts dim 2 into pieces (per sample), a tuple whose length the indices give",
    "nn.functional.nll_loss": "the sample is one unbatched input (C,) with a 0-dim target: its dim 0 is classes",
    "linalg.vander": "a 1-D x: the rule takes its only dim for the vector of points (a batched x splits)",
    "linalg.pinv": "a 2-D input is one matrix; with rtol=1 every singular value is cut and the output is zeros, "
                   "which any join matches",
    "masked.logaddexp": "no rule written yet: element-wise in input and other, with two masks to split alike",
    "torch.ops.aten._safe_softmax.default": "a private ATen op (softmax giving 0 on all -inf rows) that neither "
                                            "frontend records here; no rule written yet",
    **dict.fromkeys(["atleast_1d", "atleast_2d", "atleast_3d"],
                    "in the ATen capture a tensor already of that rank passes through: the graph returns its input, "
                    "there is no op to split (the fx spelling splits)"),
    # ---- no-ops of the ATen capture
    **dict.fromkeys(["conj", "conj_physical", "positive", "real", "resolve_conj", "resolve_neg"], _NO_OP),
}  # fmt: skip


def reason_for(name: str) -> str | None:
    """The reason for OpInfo op ``name`` (``"index_reduce.amax"``), or for its op without the variant."""
    if name in WHOLE_REASONS:
        return WHOLE_REASONS[name]
    base = name.rsplit(".", 1)[0]
    return WHOLE_REASONS.get(base) if base != name else None


def _whole(reason: str) -> Rule:
    def whole(ctx: RuleContext) -> Placement | None:
        return Whole(reason=f"{getattr(ctx.node.target, '__name__', ctx.node.target)}: {reason}")

    return whole


def _target(name: str) -> object | None:
    value: object = torch
    for atom in name.split("."):
        value = getattr(value, atom, None)
        if value is None:
            return None
    return value if callable(value) and not isinstance(value, type) else None


def register() -> None:
    """A whole rule, with its reason, for each op of the table that has no rule at all."""
    for name, reason in WHOLE_REASONS.items():
        target = _target(name)
        if target is not None and BATCH_RULES.function_rule(target) is None:
            BATCH_RULES.register(target, _whole(reason))
        method = name.split(".")[-1]
        if "." not in name and hasattr(torch.Tensor, method) and method not in BATCH_RULES.methods:
            BATCH_RULES.register(method, _whole(reason))


__all__ = ["WHOLE_REASONS", "reason_for"]
