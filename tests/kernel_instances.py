"""Every kernel of the Numba backend, of every data format and mode, made (not compiled): the
kernels are made on the first launch that needs them, so a test that walks them makes them
first."""

from __future__ import annotations

import torch

from detsum import kernels as K

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
RULES = (K.WIDE, K.KAHAN, K.ROUND_EACH)
REDUCES = (K.SUM, K.MEAN, K.PROD, K.AMAX, K.AMIN)


def every_kernel():
    """Each kernel once: a dispatcher, a parallel kernel or an ``instances.Blocks``."""
    from detsum.kernels.numba import exact, outer, scatter, segment, small, weighted
    from detsum.kernels.numba.variants import variant_for

    variants = {variant_for(reduce, rule, scaled)
                for reduce in REDUCES for rule in RULES for scaled in (False, True)}
    for dtype in DTYPES:
        yield from (segment.kernel_for(dtype, variant) for variant in variants)
        yield from (scatter.kernel_for(dtype, variant) for variant in variants)
        yield from (exact.kernel_for(dtype, is_mean, first_stage)
                    for is_mean in (False, True) for first_stage in (False, True))
        yield from (small._kernel_for(dtype, rule, template)
                    for template in (small._index_add_at, small._mean_at) for rule in RULES)
        yield from (small._segment_kernel_for(dtype, reduce, rule)
                    for reduce in small.SEGMENT_REDUCTIONS
                    for rule in (RULES if reduce in (K.SUM, K.MEAN) else (K.WIDE,)))
        yield from (small._extreme_kernel_for(dtype, maximum) for maximum in (False, True))
        yield from (weighted._kernel_for(template, dtype, kahan)
                    for template in (weighted._forward, weighted._dots) for kahan in (False, True))
        yield from (outer._kernel_for(template, dtype) for template in (outer._wide, outer._kahan))
