"""Linear algebra on stacks of matrices (``torch.linalg.*`` and the older ``torch.det``,
``torch.svd``, ...): each matrix of the stack is solved, factored or inverted on its own, so the
op is per sample wherever the batch dim is one of the stack's leading dims (not one of the
matrix's last two). Their ATen forms (``aten._linalg_det``, ``aten._linalg_svd``) share the rule."""

from __future__ import annotations

import torch

from dpcompile.analysis.batch_rules.over_dims import leading_dims, register_unclaimed

# one matrix in, one or more results per matrix out
_MATRIX_OPS = """
    det slogdet inv inv_ex pinv matrix_exp matrix_power cholesky cholesky_ex qr svd svdvals eig eigvals eigh
    eigvalsh lu lu_factor lu_factor_ex cond matrix_rank ldl_factor ldl_factor_ex solve solve_ex solve_triangular
    lu_solve householder_product ldl_solve lstsq
""".split()
_TORCH_OPS = """
    det logdet slogdet inverse pinverse matrix_exp matrix_power cholesky cholesky_inverse cholesky_solve qr svd
    geqrf ormqr triangular_solve lu_solve lu_unpack lu
""".split()
_ATEN_OPS = """
    _linalg_det _linalg_slogdet linalg_matrix_exp linalg_inv_ex _linalg_svd linalg_qr _linalg_eigh
    linalg_cholesky_ex linalg_lu_factor_ex linalg_lu _linalg_solve_ex linalg_solve_triangular
    linalg_householder_product linalg_eig linalg_ldl_factor_ex linalg_lu_solve logdet linalg_pinv geqrf ormqr
    triangular_solve cholesky_solve cholesky_inverse lu_unpack linalg_matrix_power linalg_cholesky linalg_det
    linalg_slogdet linalg_inv linalg_svd linalg_svdvals linalg_eigvals linalg_eigh linalg_eigvalsh linalg_solve
    linalg_lstsq
""".split()

stacked_matrices = leading_dims(2)
# linalg.matrix_norm / linalg.diagonal on the last two dims unless given others
matrix_dims = leading_dims(2, fixed=("dim", "dim1", "dim2"), params=("A", "ord", "dim", "keepdim"))
# linalg.vander(x, N=None): a row of powers per element of the last dim
vectors = leading_dims(1)


def register() -> None:
    register_unclaimed(stacked_matrices, [getattr(torch.linalg, n) for n in _MATRIX_OPS])
    register_unclaimed(stacked_matrices, [getattr(torch, n) for n in _TORCH_OPS if hasattr(torch, n)])
    register_unclaimed(stacked_matrices, [n for n in _TORCH_OPS if hasattr(torch.Tensor, n)])
    register_unclaimed(stacked_matrices, [f"aten.{n}" for n in _ATEN_OPS])
    register_unclaimed(matrix_dims, [torch.linalg.matrix_norm, torch.linalg.diagonal])
    register_unclaimed(vectors, [torch.linalg.vander, "aten.linalg_vander"])


register()
