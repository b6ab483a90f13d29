"""``benchmarks.gpu_profile``'s kernel categories, on kernel names an H200 profile of a Llama-3-8B step showed."""

from lora_sweep.benchmarks.gpu_profile import category


def test_kernels_fall_in_their_categories() -> None:
    assert category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26") == "attention"  # not gemm
    assert category("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert category("_seg_expand_kernel") == "lora"
    assert category("_rms_norm_bwd_kernel") == "fused base"
    assert category("void at::native::multi_tensor_apply_kernel<at::native::FusedAdamMathFunctor>") == "multi-tensor"
    assert category("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add>") == "elementwise"
    assert category("void at::native::CatArrayBatchedCopy<OpaqueType<2u>>") == "copy"
    assert category("cunn_SoftMaxBackward") == "other"
