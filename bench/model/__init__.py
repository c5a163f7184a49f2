"""Analytical model of a whole inference step (decode, prefill, vision encoder) over tp, dp and component DP sizes.

Every figure it produces is *modelled*. Hardware constants come from ``nkisim.hardware``.
"""

from bench.model.analytical import (  # noqa: F401
    Bucket,
    InvalidConfig,
    ParallelConfig,
    StepResult,
    evaluate,
    evaluate_decode,
    evaluate_prefill,
    evaluate_vision,
)
from bench.model.hardware import Instance, get_instance, instances  # noqa: F401
