"""nkisim cost model: a modelled per-engine timeline, roofline figures and a Chrome/Perfetto trace for a kernel run.

    import nkisim
    out, rep = nkisim.profile(kernel, a, b, target="trn2")      # kernel[2] for LNC=2; kwargs go to the kernel
    print(rep.summary())                                         # every figure labelled "modelled"
    rep.latency_s, rep.bound, rep.bound_engine, rep.roofline_fraction, rep.mfu, rep.mbu, rep.busy_s
    rep.save_trace("kernel.trace.json")                          # open in ui.perfetto.dev / chrome://tracing
    rep2 = nkisim.cost.analyze(nkisim.run(kernel, args, {}, target="trn3"))   # for an existing RunResult

Design note
-----------
What is modelled (every figure printed is an estimate from this model, never a measurement):
- per-instruction costs from nki-api.md §8.4 over the hardware table `nkisim.hardware` (trn1/trn2/trn3):
  TensorE MultiplyMoving max(N, 64) cycles at the TensorE clock for bf16/fp16/tf32/fp8, fp32 4x slower, fp8
  double_row doing twice the contraction in the same cycles (2x FLOP/s); nc_transpose as a matmul with no useful
  FLOPs. VectorE N cycles per streaming input (N = elements per partition; per-partition scalar operands are free),
  trn2+ perf modes for bf16/fp16 (trn3 also fp8) SBUF-contiguous operands: tensor_copy/tensor_scalar 4x,
  tensor_tensor 2x; plus ~100 cycles static overhead. ScalarE N cycles (trn3: N/2 for 2-/1-byte dtypes) plus a
  264-cycle fixed cost. GpSimd N cycles per streaming input plus static overhead. DMA: bytes over the queue
  bandwidth, each queue capped at its share of the core's HBM bandwidth when it touches HBM (twice for HBM->HBM),
  efficiency run/(run + 256 B) from the contiguous bytes per partition, dma_transpose at 90% of that, a fixed
  1.3 us start latency that does not occupy a queue, the transfer split over up to 16 queues (>= 2 KiB each).
- a list scheduler (`schedule.py`): engines in parallel, each in program order; RAW/WAR/WAW dependencies on
  allocation footprints; in-order DMA issue with FIFO queues; LNC=2 cores coupled at sendrecv/core_barrier.
- outputs: latency, busy time per engine, critical path (and its split per engine / DMA latency), HBM bytes,
  TensorE FLOPs, MFU (vs the per-dtype datasheet TensorE peak), MBU (vs the core's HBM share), arithmetic
  intensity, ridge point, roofs per resource, roofline bound (compute with its engine, or memory) and fraction.
What is not modelled: SBUF/PSUM bank conflicts and the >16 B-stride SBUF bandwidth halving; clock throttling or
power ramps; cross-engine semaphore latency between compute engines; LoadStationary (assumed hidden in the
background); concurrent TensorE row/column tiles; HBM page/refresh effects and sharing of one HBM stack between the
two cores of an LNC pair beyond each core's 1/8 share; DMA descriptor-generation limits of SW-DGE (GpSimd);
allocator address reuse (distinct allocations never alias, so buffering depth is what the kernel allocates);
instruction fetch, control flow and register-loop overheads (sync-engine instructions take no time);
collectives beyond the two-core LNC sync.
Calibration status: no constant has been calibrated on hardware (no Trainium here). Clocks, widths, peaks, SBUF/
PSUM sizes, DMA and HBM bandwidths are datasheet values (nkisim.hardware, with sources); the fixed overheads
(1.3 us DMA latency, 100-cycle static overhead, 264-cycle ScalarE cost, 64-cycle matmul II) are documented
approximations; the DMA efficiency curve and the 90% dma_transpose factor are fits to documented statements.
"""

from collections import namedtuple

from ..hardware import HARDWARE, hardware  # noqa: F401
from .costs import OpCost, instruction_cost  # noqa: F401
from .report import MODELLED, CostReport, check_chrome_trace  # noqa: F401
from .schedule import Event, Scheduler  # noqa: F401

Profile = namedtuple("Profile", ["outputs", "report"])


def analyze(result, target=None, kernel_name="") -> CostReport:
    """Schedule the traces of a `RunResult` (from nkisim.run) and return the modelled CostReport."""
    tgt = target if target is not None else result.target
    platform = hardware(tgt)
    events = Scheduler(platform.core).run(result.traces)
    return CostReport(platform, len(result.contexts), events, kernel_name=kernel_name)


def profile(kernel, *args, target="trn2", **kwargs) -> Profile:
    """Run `kernel` (a jit Kernel, `kernel[2]` for LNC=2, or a plain function) on the CPU interpreter for `target`
    and return `Profile(outputs, report)`; `report` is a CostReport of modelled figures."""
    from ..jit import Kernel, run
    k = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
    result = run(k, args, kwargs, target=target)
    name = getattr(k.func, "__name__", "")
    return Profile(result.outputs, analyze(result, kernel_name=name))
