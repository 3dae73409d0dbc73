"""Number formats, in pure PyTorch: the specification every kernel and every checkpoint writer follows."""

from .e2m1 import (E2M1_MAX, E2M1_VALUES, PACKED_DTYPES, as_packed_u8, decode_e2m1, dequantize_e2m1_blocks,
                   encode_e2m1, pack_e2m1, unpack_e2m1, view_packed)
from .fp8 import FP8_BLOCK, FP8_SCALE_DTYPES, dequantize_fp8_block, expand_block_scale, quantize_fp8_block
from .mxfp4 import MXFP4_BLOCK, dequantize_mxfp4, mxfp4_k_max, mxfp4_to_nvfp4, quantize_mxfp4
from .nvfp4 import (NVFP4_BLOCK, dequantize_nvfp4, nvfp4_global_scale, quantize_nvfp4, stage_activation,
                    w4a4_matmul_ref)
from .scales import E4M3_MAX, UE8M0_DTYPE, float_to_ue8m0, pow2_ceil, to_e4m3_saturating, ue8m0_to_float
from .swizzle import swizzle_128x4, unswizzle_128x4
from .tiling import TILE_BYTES, TILE_ROWS, scale_chunk, tile_bytes, tile_bytes_, untile_bytes, why_untileable
from .qweight import FORMATS, FP4_FORMATS, QWeight
