"""Paged attention in Pallas, with pure-JAX references.

KV cache, for keys and for values alike: the stacked cache of every layer

    [num_layers, num_kv_heads, num_blocks, block_size, head_dim]

with an int32 scalar `layer` naming the layer an op reads or writes (a model
scanning over its layers carries the whole cache and passes its layer index, so
no layer is sliced out and a donated cache is updated in place), or the cache
of one layer [num_kv_heads, num_blocks, block_size, head_dim] with no `layer`.

Flat slot `s` is block `s // block_size`, offset `s % block_size`; block 0 is
the reserved null block that padding points at.

Why this layout:

- Head outermost within a layer. A kernel instance serves one KV head, so
  every page it reads lies in one [num_blocks, block_size, head_dim] slab and a
  page's address is one multiply-add on its id. Sharding the cache over heads
  (tensor parallelism) splits the head axis.
- A page of one head is one contiguous [block_size, head_dim] run. On TPU the
  two minor dimensions are the (sublane, lane) plane of the (8, 128) memory
  tiles (16 sublanes for bfloat16): head_dim spans the lanes, tokens the
  sublanes. With block_size a multiple of 8 (bfloat16: 16) a page is a whole
  number of tiles, so one DMA copies it with no padding or relayout and it lands
  in VMEM as the key operand of the MXU matmul. (head_dim 64 leaves half of
  every lane row empty; 128 fills it.) On GPU a key row is head_dim contiguous
  elements (256 bytes in bfloat16 at head_dim 128) and the rows of a page follow
  each other, so a warp's loads are whole 128-byte lines, and Triton's tile
  loads need no shuffle (vLLM's CUDA kernel split head_dim into x-element
  vectors for its own thread mapping; tile loads do not need that).
- Keys and values in separate arrays: each kernel loop reads matching pages of
  both, and writing a token touches num_kv_heads rows of head_dim in each.

A quantized cache replaces each of the two arrays by `EncodedPages` (int8 or fp8
values plus float32 scales [..., num_blocks, block_size], one per token and KV head;
quantization.py); every op below takes either kind.

Public ops (all usable under jit with the cache donated):

    paged_decode_attention   one new token per sequence
    ragged_paged_attention   prefill, chunked prefill and mixed batches
    write_kv                 store this step's K/V at slot_mapping
"""

from kernels_pallas.attention import (
    FALLBACKS,
    IMPLEMENTATIONS,
    Implementation,
    check_cache_layout,
    default_block_size,
    default_implementation,
    mosaic_gpu_support,
    paged_decode_attention,
    pallas_implementation,
    ragged_paged_attention,
)
from kernels_pallas.quantization import EncodedPages
from kernels_pallas.reference import (
    paged_decode_attention_reference,
    ragged_paged_attention_reference,
    write_kv_reference,
)
from kernels_pallas.write_kv import write_kv

__all__ = [
    "FALLBACKS",
    "IMPLEMENTATIONS",
    "Implementation",
    "EncodedPages",
    "check_cache_layout",
    "default_block_size",
    "default_implementation",
    "mosaic_gpu_support",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "pallas_implementation",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "write_kv",
    "write_kv_reference",
]
