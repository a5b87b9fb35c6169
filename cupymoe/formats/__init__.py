# SPDX-License-Identifier: Apache-2.0
"""The FP4 number formats and expert weights: E2M1 / E4M3 / E8M0 codes (:mod:`.codes`),
``Fp4Experts`` and the quantizers (:mod:`.experts`), and their GPU upload ``DeviceFp4``
(:mod:`.device`)."""

from .codes import (
    E2M1_VALUES,
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    encode_e2m1,
    encode_e4m3,
    encode_e8m0_exponent,
    from_pair_interleaved,
    pack_fp4,
    to_pair_interleaved,
    unpack_fp4,
)
from .device import DeviceFp4, random_fp4_gpu
from .experts import ExpertShape, Fp4Experts, Fp4Format, MxScaleRule

__all__ = [
    "E2M1_VALUES",
    "DeviceFp4",
    "ExpertShape",
    "Fp4Experts",
    "Fp4Format",
    "MxScaleRule",
    "decode_e2m1",
    "decode_e4m3",
    "decode_e8m0",
    "encode_e2m1",
    "encode_e4m3",
    "encode_e8m0_exponent",
    "from_pair_interleaved",
    "pack_fp4",
    "random_fp4_gpu",
    "to_pair_interleaved",
    "unpack_fp4",
]
