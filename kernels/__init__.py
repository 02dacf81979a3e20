"""Compute kernels: paged attention (torch reference + flashinfer on CUDA), KV page scatter/gather,
grouped MoE and FP8 block dequantization.

Every GPU path has a torch reference here that runs on CPU; GPU-marked tests compare the two.
"""

from kernels.attention import paged_attention
from kernels.attn_plan import AttnPlan, plan_paged_attention
from kernels.fp8 import dequant_fp8_block
from kernels.kv import gather_kv, kv_slot_mapping, scatter_kv
from kernels.moe import grouped_moe, sigmoid_topk_route

__all__ = [
    "AttnPlan",
    "dequant_fp8_block",
    "gather_kv",
    "grouped_moe",
    "kv_slot_mapping",
    "paged_attention",
    "plan_paged_attention",
    "scatter_kv",
    "sigmoid_topk_route",
]
