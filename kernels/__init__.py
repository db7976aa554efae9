"""Triton kernels for paged attention, each beside its plain torch reference (docs/kernels.md).

Importing this package imports triton: on a machine without a GPU set TRITON_INTERPRET=1 first.
"""

from kvscope.kernels.cache_write import write_kv_cache
from kvscope.kernels.mla_decode import mla_decode_attention
from kvscope.kernels.paged_decode import paged_decode_attention
from kvscope.kernels.paged_prefill import paged_prefill_attention

__all__ = ["mla_decode_attention", "paged_decode_attention", "paged_prefill_attention", "write_kv_cache"]
