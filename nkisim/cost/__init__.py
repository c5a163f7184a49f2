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
  double_row doing twice the contraction in the same cycles (2x FLOP/s); nc_transpose of data [p, f] as a matmul
  with data stationary and a [p, p] identity moving (max(p, 64) cycles, no useful FLOPs). VectorE N cycles per
  streaming input (N = elements per partition; per-partition scalar operands are free), trn2+ perf modes for
  bf16/fp16 (trn3 also fp8) SBUF-contiguous operands: tensor_copy/tensor_scalar 4x, tensor_tensor 2x; plus ~100
  cycles static overhead. ScalarE N cycles (trn3: N/2 for 2-/1-byte dtypes) plus a
  264-cycle fixed cost. GpSimd N cycles per streaming input plus static overhead. DMA: bytes over the queue
  bandwidth, each queue capped at its share of the core's HBM bandwidth when it touches HBM (twice for HBM->HBM),
  efficiency run/(run + 256 B) from the contiguous bytes per partition, dma_transpose at 90% of that, a fixed
  1.3 us start latency that does not occupy a queue, the transfer split over up to 16 queues (>= 2 KiB each).
  SBUF access stride: a compute instruction (VectorE/ScalarE/GpSimd) any of whose SBUF operands, read or written,
  streams with an innermost free-dim stride > 16 B (`Access.stride_bytes`) takes 2x for its streaming part (half
  SBUF bandwidth, applied whole — the "up to 2x" upper bound); for TensorE only the moving operand counts
  (max(2N, 64)). Per-partition scalars and broadcasts (stride 0) never trigger it; PSUM operands are exempt.
- dependencies beyond data operands (recorded at emit time, ordered by the scheduler, never costed):
  * address dependencies `Access.deps`: the index tensor of an indirect view (`.ap(vector_offset=...)`,
    `vector_select`, on a DMA's src or dst) and the registers / 1-element tensors a dynamic offset was built from
    (`nl.ds(reg, n)`, `.ap(scalar_offset=reg)`, `t[reg]`, `select(dim, reg)`; kept by derived views in the slot
    `NkiTensor._regs`). The instruction waits for their producers (reason "RAW address" / "RAW register"); index
    and offset tensors also count as reads for WAR.
  * registers: each `VirtualRegister` has an id and is a pseudo-allocation (buffer "reg", alloc_id -id).
    register_alloc / register_move / register_load write it (and record `reg.writer`, the seq), register_move /
    register_store read their source register; register_load reads its source tile, so it waits for that tile's
    producer. Register reads create RAW only (an engine reads the register when it issues the instruction, so a
    later register write does not wait for a DMA that used the old value). Register instructions run on the
    "sync" sequencer: in program order, zero time (so a register_load that waits also delays later sync ops).
  * control dependencies `Instruction.deps`: inside `nl.fori_loop` with register / tensor bounds and
    `nl.while_loop` (the condition register) every instruction depends on the bound / condition's writer. The
    induction register of fori_loop has no recorded writer (each engine steps its own copy): static loops are
    unaffected. `nl.dynamic_range` (deprecated, returns a plain range) records no control dependency.
- a list scheduler (`schedule.py`): engines in parallel, each in program order; RAW/WAR/WAW dependencies on
  allocation footprints; in-order DMA issue with FIFO queues; LNC=2 cores coupled at sendrecv/core_barrier.
- outputs: latency, busy time per engine, critical path (and its split per engine / DMA latency), HBM bytes,
  TensorE FLOPs, MFU (vs the per-dtype datasheet TensorE peak), MBU (vs the core's HBM share), arithmetic
  intensity, ridge point, roofs per resource, roofline bound (compute with its engine, or memory) and fraction.
What is not modelled: SBUF/PSUM bank conflicts; the stride rule per operand (one strided input of two costs the
same 2x as all); clock throttling or power ramps; cross-engine semaphore latency between compute engines;
LoadStationary (assumed hidden in the background); concurrent TensorE row/column tiles; HBM page/refresh effects
and sharing of one HBM stack between the two cores of an LNC pair beyond each core's 1/8 share; DMA
descriptor-generation limits of SW-DGE (GpSimd); allocator address reuse (distinct allocations never alias, so
buffering depth is what the kernel allocates); instruction fetch, control flow and register-loop overheads
(sync-engine instructions take no time); collectives beyond the two-core LNC sync.
Calibration status: no constant has been calibrated on hardware (no Trainium here). Clocks, widths, peaks, SBUF/
PSUM sizes, DMA and HBM bandwidths are datasheet values (nkisim.hardware, with sources); the fixed overheads
(1.3 us DMA latency, 100-cycle static overhead, 264-cycle ScalarE cost, 64-cycle matmul II) are documented
approximations; the DMA efficiency curve and the 90% dma_transpose factor are fits to documented statements.
Open doubts (kept, not clearly wrong): trn2/trn3 VectorE is listed at 256 non-perf-mode elems/cycle (§8.1) while
the model uses the §8.4 per-instruction rule (N cycles per input = 128/cycle), possibly 2x pessimistic for fp32;
GpSimd is modelled at 128 elems/cycle for every dtype although v2/v3 SIMD lanes hold 32 x 16-bit (2x for bf16);
the 264-cycle ScalarE fixed cost is the II of *dependent* 1-element instructions (an NC-v2 figure) and is charged
to every ScalarE instruction; DMA dtype casts and HW-DGE descriptor time (600 ns, assumed hidden) cost nothing.
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
