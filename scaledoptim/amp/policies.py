"""Cast policies and torch's default autocast tables, as data.

The policy names are the ones ATen uses for ``at::autocast::CastPolicy``:

* ``"lower_precision_fp"``: cast floating inputs to the region's dtype (fp16/bf16).
* ``"fp32"``: cast floating inputs to float32.
* ``"promote"``: cast floating inputs to the widest floating dtype among them.
* ``"fp32_set_opt_dtype"``: when the first input is eligible, pass ``dtype=torch.float32``
  unless the caller gave a dtype; inputs are not cast.
* ``"fp32_append_dtype"``: redispatch to the sibling overload that takes a trailing
  ``dtype`` and pass ``torch.float32`` (``norm.Scalar`` -> ``norm.ScalarOpt_dtype``).

``None`` means the op has no autocast kernel: it falls through the autocast key.

Note [default tables]
~~~~~~~~~~~~~~~~~~~~~
The tables below are the op lists of ATen's ``autocast_mode.cpp``
for torch 2.13, keyed by dispatcher name (``"aten::mm"`` is the default overload,
``"aten::softmax.int"`` a named one). ``tests/amp/test_policies.py`` checks that the set of
ops in each table is exactly the set the installed torch has an Autocast kernel for, and
probes the policy of every op the parity tests cover against ``torch.autocast``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

LOWER_PRECISION_FP = "lower_precision_fp"
FP32 = "fp32"
PROMOTE = "promote"
FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
FP32_APPEND_DTYPE = "fp32_append_dtype"

#: Every policy name :func:`set_policy` accepts, in ATen's ``at::autocast::CastPolicy`` terms
#: (``None`` besides these means the op falls through autocast):
#:
#: * ``"lower_precision_fp"``: cast floating inputs to the region's dtype (fp16/bf16).
#: * ``"fp32"``: cast floating inputs to float32.
#: * ``"promote"``: cast floating inputs to the widest floating dtype among them.
#: * ``"fp32_set_opt_dtype"``: pass ``dtype=torch.float32`` unless the caller gave a dtype.
#: * ``"fp32_append_dtype"``: call the overload that takes a trailing ``dtype``, with float32.
POLICY_NAMES: tuple[str, ...] = (
    LOWER_PRECISION_FP,
    FP32,
    PROMOTE,
    FP32_SET_OPT_DTYPE,
    FP32_APPEND_DTYPE,
)

#: The dispatch key of each device type this module supports.
AUTOCAST_DISPATCH_KEYS: Mapping[str, str] = MappingProxyType(
    {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}
)


def _table(**ops_by_policy: tuple[str, ...]) -> Mapping[str, str]:
    return MappingProxyType(
        {op: policy for policy, ops in ops_by_policy.items() for op in ops}
    )


_CPU_TABLE = _table(
    lower_precision_fp=(
        "aten::_addmm_activation", "aten::_convolution.deprecated",
        "aten::_native_multi_head_attention", "aten::addbmm", "aten::addmm", "aten::baddbmm",
        "aten::bmm", "aten::conv1d", "aten::conv1d.padding", "aten::conv2d",
        "aten::conv2d.padding", "aten::conv3d", "aten::conv3d.padding", "aten::conv_tbc",
        "aten::conv_transpose1d", "aten::conv_transpose2d.input",
        "aten::conv_transpose3d.input", "aten::linalg_vecdot", "aten::linear", "aten::matmul",
        "aten::mkldnn_rnn_layer", "aten::mm", "aten::prelu", "aten::scaled_dot_product_attention",
    ),
    fp32=(
        "aten::_grid_sampler_2d_cpu_fallback", "aten::_lu_with_info", "aten::adaptive_avg_pool3d",
        "aten::adaptive_max_pool3d", "aten::avg_pool3d", "aten::binary_cross_entropy",
        "aten::binary_cross_entropy_with_logits", "aten::cdist", "aten::cholesky",
        "aten::cholesky_inverse", "aten::cholesky_solve", "aten::cosine_embedding_loss",
        "aten::cross_entropy_loss", "aten::ctc_loss.IntList", "aten::ctc_loss.Tensor",
        "aten::fake_quantize_per_tensor_affine", "aten::fft_fft", "aten::fft_fft2",
        "aten::fft_fftn", "aten::fft_hfft", "aten::fft_ifft", "aten::fft_ifft2",
        "aten::fft_ifftn", "aten::fft_ihfft", "aten::fft_irfft", "aten::fft_irfft2",
        "aten::fft_irfftn", "aten::fft_rfft", "aten::fft_rfft2", "aten::fft_rfftn",
        "aten::fractional_max_pool2d", "aten::fractional_max_pool3d", "aten::geqrf",
        "aten::grid_sampler", "aten::grid_sampler_2d", "aten::grid_sampler_3d",
        "aten::hinge_embedding_loss", "aten::huber_loss", "aten::inverse", "aten::kl_div",
        "aten::l1_loss", "aten::linalg_cholesky", "aten::linalg_cholesky_ex",
        "aten::linalg_cond", "aten::linalg_cond.p_str", "aten::linalg_eig", "aten::linalg_eigh",
        "aten::linalg_eigvals", "aten::linalg_eigvalsh", "aten::linalg_householder_product",
        "aten::linalg_inv", "aten::linalg_inv_ex", "aten::linalg_lstsq",
        "aten::linalg_matrix_rank", "aten::linalg_matrix_rank.atol_rtol_float",
        "aten::linalg_matrix_rank.atol_rtol_tensor", "aten::linalg_matrix_rank.tol_tensor",
        "aten::linalg_qr", "aten::linalg_solve", "aten::linalg_svd", "aten::linalg_svdvals",
        "aten::linalg_tensorinv", "aten::linalg_tensorsolve", "aten::lu_solve",
        "aten::margin_ranking_loss", "aten::max_pool3d", "aten::max_unpool2d",
        "aten::max_unpool3d", "aten::mse_loss", "aten::multi_margin_loss",
        "aten::multilabel_margin_loss", "aten::multilabel_margin_loss_forward",
        "aten::nanquantile", "aten::nanquantile.scalar", "aten::nll_loss", "aten::nll_loss2d",
        "aten::orgqr", "aten::ormqr", "aten::pinverse", "aten::poisson_nll_loss", "aten::polar",
        "aten::prod", "aten::prod.dim_int", "aten::qr", "aten::quantile",
        "aten::quantile.scalar", "aten::reflection_pad1d", "aten::reflection_pad2d",
        "aten::replication_pad1d", "aten::replication_pad2d", "aten::replication_pad3d",
        "aten::smooth_l1_loss", "aten::soft_margin_loss", "aten::stft", "aten::stft.center",
        "aten::svd", "aten::trace", "aten::triangular_solve", "aten::triplet_margin_loss",
        "aten::view_as_complex",
    ),
    promote=("aten::cat", "aten::index_copy", "aten::stack"),
)

_CUDA_TABLE = _table(
    lower_precision_fp=(
        "aten::_convolution", "aten::_convolution.deprecated",
        "aten::_scaled_dot_product_flash_attention", "aten::_thnn_fused_gru_cell",
        "aten::_thnn_fused_lstm_cell", "aten::addbmm", "aten::addmm", "aten::addmv",
        "aten::addr", "aten::baddbmm", "aten::bmm", "aten::chain_matmul", "aten::conv1d",
        "aten::conv2d", "aten::conv3d", "aten::conv_tbc", "aten::conv_transpose1d",
        "aten::conv_transpose2d.input", "aten::conv_transpose3d.input", "aten::convolution",
        "aten::cudnn_convolution", "aten::cudnn_convolution_transpose", "aten::einsum",
        "aten::gru_cell", "aten::linalg_multi_dot", "aten::linalg_vecdot", "aten::linear",
        "aten::lstm_cell", "aten::matmul", "aten::mm", "aten::mv", "aten::prelu",
        "aten::rnn_relu_cell", "aten::rnn_tanh_cell", "aten::scaled_dot_product_attention",
    ),
    fp32=(
        "aten::_upsample_bicubic2d_aa", "aten::_upsample_bilinear2d_aa",
        "aten::_upsample_nearest_exact1d", "aten::_upsample_nearest_exact2d",
        "aten::_upsample_nearest_exact3d", "aten::acos", "aten::asin",
        "aten::binary_cross_entropy_with_logits", "aten::cdist", "aten::cosh",
        "aten::cosine_embedding_loss", "aten::cosine_similarity", "aten::dist", "aten::erfinv",
        "aten::exp", "aten::expm1", "aten::frobenius_norm.dim", "aten::group_norm",
        "aten::hinge_embedding_loss", "aten::huber_loss", "aten::kl_div", "aten::l1_loss",
        "aten::layer_norm", "aten::log", "aten::log10", "aten::log1p", "aten::log2",
        "aten::logsumexp", "aten::margin_ranking_loss", "aten::mse_loss",
        "aten::multi_margin_loss", "aten::multilabel_margin_loss", "aten::native_layer_norm",
        "aten::nll_loss", "aten::nll_loss2d", "aten::nuclear_norm", "aten::nuclear_norm.dim",
        "aten::pdist", "aten::poisson_nll_loss", "aten::pow.Scalar", "aten::pow.Tensor_Scalar",
        "aten::pow.Tensor_Tensor", "aten::reciprocal", "aten::renorm", "aten::rms_norm",
        "aten::rsqrt", "aten::sinh", "aten::smooth_l1_loss", "aten::soft_margin_loss",
        "aten::softplus", "aten::tan", "aten::triplet_margin_loss", "aten::upsample_bicubic2d",
        "aten::upsample_bilinear2d", "aten::upsample_linear1d", "aten::upsample_nearest1d",
        "aten::upsample_nearest2d", "aten::upsample_nearest3d", "aten::upsample_trilinear3d",
    ),
    promote=(
        "aten::addcdiv", "aten::addcmul", "aten::atan2", "aten::bilinear", "aten::cross",
        "aten::dot", "aten::grid_sampler", "aten::index_put", "aten::scatter_add",
        "aten::tensordot", "aten::vdot",
    ),
    fp32_set_opt_dtype=(
        "aten::cumprod", "aten::cumsum", "aten::linalg_matrix_norm",
        "aten::linalg_matrix_norm.str_ord", "aten::linalg_vector_norm", "aten::log_softmax.int",
        "aten::prod", "aten::prod.dim_int", "aten::softmax.int", "aten::sum",
        "aten::sum.dim_IntList",
    ),
    fp32_append_dtype=("aten::norm.Scalar", "aten::norm.ScalarOpt_dim"),
)

#: torch's default policy of every op that has an Autocast kernel, per device type:
#: ``DEFAULT_POLICIES[device_type][op]`` is a name from :data:`POLICY_NAMES`, for
#: ``device_type`` ``"cpu"`` or ``"cuda"`` and ``op`` a dispatcher name such as ``"aten::mm"``
#: (the default overload) or ``"aten::softmax.int"``. An op missing from a table has no
#: autocast kernel on that device. Read-only; :func:`get_policy` gives the policy in effect,
#: edits included.
#:
#: Example::
#:
#:     >>> from scaledoptim.amp import DEFAULT_POLICIES
#:     >>> DEFAULT_POLICIES["cuda"]["aten::mm"], DEFAULT_POLICIES["cpu"]["aten::cat"]
#:     ('lower_precision_fp', 'promote')
#:     >>> "aten::relu" in DEFAULT_POLICIES["cpu"]
#:     False
DEFAULT_POLICIES: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {"cpu": _CPU_TABLE, "cuda": _CUDA_TABLE}
)

#: Ops whose torch Autocast kernel raises instead of casting ("unsafe to autocast").
UNSAFE_TO_AUTOCAST: Mapping[str, frozenset[str]] = MappingProxyType(
    {"cpu": frozenset(), "cuda": frozenset({"aten::binary_cross_entropy"})}
)


def default_policy(op_name: str, device_type: str) -> str | None:
    """Return torch's own policy for the dispatcher name ``op_name`` on ``device_type``.

    Args:
        op_name: dispatcher name such as ``"aten::mm"`` or ``"aten::softmax.int"``.
        device_type: ``"cpu"`` or ``"cuda"``.

    Returns:
        The ATen policy name, or ``None`` when torch has no autocast kernel for the op.
    """
    return DEFAULT_POLICIES[device_type].get(op_name)
