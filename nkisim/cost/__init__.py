"""nkisim cost model: a modelled per-engine timeline, roofline figures and a Chrome/Perfetto trace for a kernel run.

    import nkisim
    out, rep = nkisim.profile(kernel, a, b, target="trn2")      # kernel[2] for LNC=2; kwargs go to the kernel
    print(rep.summary())                                         # every figure labelled "modelled"
    rep.latency_s, rep.bound, rep.bound_engine, rep.roofline_fraction, rep.mfu, rep.mbu, rep.busy_s
    rep.save_trace("kernel.trace.json")                          # open in ui.perfetto.dev / chrome://tracing
    rep2 = nkisim.cost.analyze(nkisim.run(kernel, args, {}, target="trn3"))   # for an existing RunResult

Design note
-----------
Every figure is an estimate of this model, never a measurement. Sources: [arch1] trainium_inferentia2_arch.rst,
[arch2] trainium2_arch.rst, [arch3] trainium3_arch.rst, [perf] nki_perf_guide.rst, [dma] nki-dma-overview.rst,
[bw] nki-dma-bandwidth-guide.rst, [sched] how-to-scheduling-apis.rst + nki.language.no_reorder, [dge] nki-dge.rst
(all in aws-neuron/aws-neuron-sdk), [api] /work/shared/docs/nki-api.md §8.

Scheduling rules (schedule.py), each with its source:
1. Engines: "each compute engine has its own sequencer ... four independent instruction streams asynchronously in
   parallel"; cross-engine data dependencies are semaphores inserted by the compiler [arch1]. Modelled: one
   in-order stream per engine (tensor, vector, scalar, gpsimd, sync); RAW/WAR/WAW on allocation footprints become
   dependency edges. Semaphore latency between compute engines is not charged (no figure published).
2. Compiler reordering: "Without this directive [no_reorder], the compiler scheduler is free to reorder
   independent operations" [sched]. How well it does so is not documented, so it is a switch and both results are
   reported (`bounds(result)`): order="ready" (default) is an event-driven list schedule — an instruction is ready
   when its last dependency ends, each engine stream when free starts the ready instruction earliest in program
   order (the kernel's order is the priority; only instructions still waiting are bypassed), a DMA issues as soon
   as it is ready and each DMA engine serves the arrived transfer earliest in program order; order="program" is
   no reordering (every stream and DMA queue in program order). Neither bounds the other in general. (A first
   greedy version — place whatever is ready first, DMA engines FIFO — let prefetches occupy the DMA engines ahead
   of critical transfers and made the decode kernel up to 34% slower at long contexts; it was replaced.)
3. no_reorder: "a no-reorder block is a section of code where dependency edges are automatically [inserted]
   between every pair of instructions", dynamically scoped [sched]. Modelled: each instruction recorded inside the
   outermost block depends on (starts after the end of) the previous instruction of the block, in both orders.
4. DMA triggers and queues: a DMA is triggered by an engine sequencer instruction that waits on the semaphores of
   its inputs; "the queue ID is typically tied to the trigger engine"; "DMA transfers within a queue on the same DMA
   engine are executed in order", different queues round-robin (v2/v3) [dma]. Modelled: the queue is the
   dma_copy `engine=` (else one default queue); in program order a queue issues in program order; each DMA
   engine serves its transfers FIFO across queues (round-robin sharing is approximated by FIFO: same throughput).
5. DMA engines: "each DMA engine is typically responsible for moving data for eight SBUF partitions" and a
   [4, 4096] load uses one engine [dma]; "each DMA engine can process one DMA transfer at a time" [arch1]. Modelled:
   a transfer uses engines first_partition//8 .. last_partition//8 (HBM->HBM: split over >= 2 KiB pieces on the
   least-loaded engines), each moving its share.
6. DMA time = fixed start latency ("every DMA transfer incurs descriptor setup, synchronization, and
   semaphore-to-start latency (~1300 ns cross-engine)" [bw]; it does not occupy an engine, so consecutive
   transfers overlap it) + per engine: bytes / (engine rate x buffer efficiency) ("overhead at both DMA buffer and
   transfer levels" [arch1]: the transfer level is the latency above; `dma_transfer_overhead_s` = 0 — reading
   [perf]'s "larger than 32KiB ... for ideal bandwidth" as a 90%-at-32-KiB engine occupancy was tried and rejected,
   it made the trn2 tutorial's v2/v3 16-18% slower than measured), buffer efficiency run/(run + 256 B) from the
   contiguous bytes per partition ([bw]: < 256 B severely overhead-bound, >= 2 KiB approaches, >= 4 KiB
   saturates); engine rate 17/23/33 B/ns [bw], capped per engine at the core's HBM share / 16 when it touches HBM
   (twice for HBM->HBM); dma_transpose at 90% [arch2]. AWS's DMA throughput curve ([dma] figure, single [128, B]
   transfers) is flat in time up to ~2 KiB/partition, i.e. dominated by the fixed latency, as this rule has it.
7. Fixed instruction costs only where documented: VectorE/GpSimd 100 static cycles and ScalarE 264 cycles
   (observed II of dependent 1-element ScalarE instructions) are charged for instructions with N < 128 elements
   per partition, or when the instruction reads the output of the previous instruction on the same engine
   ([arch1] VectorE cost model, [perf] Opt #5a); independent large instructions pay none.
8. register_load / scalar_load read memory into a sequencer register, register_store / scalar_store write one
   back: with HBM on the other side each is charged as the DMA it is (start latency + bytes) on the sync sequencer,
   which waits for it; with SBUF one SBUF access (60 cycles, [arch1]). Register ALU / move ops take no time.
9. LNC=2: the k-th core_barrier / sendrecv of the two cores pair up and start together.

Per-instruction costs (costs.py), [api] §8.4 over nkisim.hardware: TensorE max(N, 64) cycles (fp32 4x, double_row
FP8 twice the contraction in the same cycles on trn2; trn3 runs non-MX FP8 at the BF16 rate [arch3]); nc_transpose
as a matmul with a [p, p] identity moving. VectorE N cycles per streaming input (128 lanes: the "256 input/output
elements per cycle" of [arch3]'s table counts one input and one output per lane), trn2+ perf modes for bf16/fp16
SBUF-contiguous operands (tensor_copy/tensor_scalar 4x, tensor_tensor 2x; trn3 also fp8) [arch2]. ScalarE N
cycles (trn3: N/2 for 2-/1-byte). GpSimd 8 x 512-bit SIMD: 128 fp32 / 256 16-bit / 512 8-bit elements per cycle
on v2/v3, 128 for all dtypes on v4. SBUF innermost stride > 16 B: 2x the streaming part (TensorE: moving operand).

Launch: `CostReport.latency_s` is the kernel body; `latency_with_launch_s` adds `launch_s`
(hardware.launch_overhead_s — an ASSUMPTION, no AWS figure found). FLOPs: `flops_issued` is what TensorE executes
(padding, mask folding, selection matmuls included); `flops` is the useful work, equal to issued unless declared
(`analyze(..., useful_flops=)`, `profile(..., useful_flops=)`, `CostReport.declare_useful_flops`); MFU and
arithmetic intensity use the useful FLOPs.

Outputs: latency, busy time per engine, critical path (split per engine / DMA latency), HBM bytes, FLOPs, MFU,
MBU, arithmetic intensity, ridge point, roofs, roofline bound and fraction (`roofline_s`, the bench's one bound).
Not modelled: SBUF/PSUM bank conflicts; the stride rule per operand; clock throttling; semaphore latency between
compute engines; LoadStationary (assumed hidden); HBM page effects and stack sharing beyond each core's 1/8 share;
SW-DGE descriptor generation time on GpSimd and HW-DGE's ~600 ns per instruction (assumed hidden behind the
trigger engine); DMA casts; allocator address reuse (buffering depth is what the kernel allocates); instruction
fetch and control-flow overheads; collectives beyond the two-core LNC sync.
Calibration: bench/calibration compares this model with AWS's published, hardware-measured tutorial timings (no
constant is fitted to them; bench/calibration/results.json, also in the HTML report). Status (modelled /
published, order "ready"; "program" in brackets): trn2 matmul tutorial v2-v5 0.90 / 0.99 / 0.99 / 0.99
(0.94 / 1.07 / 1.04 / 1.01); trn1 fused Mamba 0.95 / 1.09 (0.98 / 1.15); trn1 bf16 matmul optimization 3
(TensorE-bound) 0.86 (0.93); trn1 bf16 matmul original / optimization 1 / 2 (DMA-bound, 256 B and 1 KiB
per-partition chunks) 0.54 / 0.48 / 0.48 — about 2x optimistic, consistently, and no documented trn1 DMA constant
explains it (open).
DMA efficiency vs chunk size, what AWS documents (searched: [bw], [dma], [perf], [arch1-3], [dge], neuron-runtime
compute-comm-overlap.rst, neuron-explorer overview-device-profiles.rst; measured points in
hardware.DMA_MEASUREMENTS / DMA_THROUGHPUT_FIGURE, checked in tests/nkisim/cost/test_dma_efficiency.py):
- No formula. [bw] gives bands per partition: < 256 B "severely overhead-bound", 256 B - 2 KiB "improving",
  >= 2 KiB "approaches peak", >= 4 KiB "saturates", and names the cause as the ~1300 ns per-transfer setup /
  semaphore latency; [perf] Opt #9: "larger than 32KiB" per transfer on trn1/inf2 for ideal bandwidth (a 4 B
  transfer example; a large-transfer example at "close 70%"); the runtime's static DMA rings use 4 KiB packets, "the
  empirically determined minimum for DMA/HBM efficiency"; [arch1]: "overhead at both DMA buffer and transfer levels"
  with no figure. Nothing separates HBM-side from SBUF-side chunks, or element-wise (2-4 B runs) from bulk beyond
  "tiny"; [dge] gives only HW-DGE's ~600 ns per instruction (v3+; trn1 has no HW-DGE).
- AWS's own measurements (trn2 profiles in [dma]): 32 KiB in 8 KiB rows on one engine 1416 ns (model 1491 ns, +5%);
  2 KiB as 8 SBUF rows of 256 B (HBM side contiguous) 97 ns = 92% of the 23 B/ns peak, where this model's fitted
  run/(run+256) charges 50% (181 ns): at 256 B the documented measurement is FASTER than the model, not slower. The
  [dma] throughput figure (one [128, B] transfer) is flat in time up to ~1-2 KiB and bytes-bound beyond (at 4 KiB
  already 97% of the 32 KiB throughput): max(fixed time, bytes / peak) rather than latency + bytes.
- The published trn1 figures per transfer: optimization 1 = 42.96 ms / 32768 rhs loads ([128, 512] bf16, 8 KiB per
  engine in 1 KiB rows) = 1.31 us each; optimization 2 = 22.07 ms / 16384 = 1.35 us; original = 51.80 ms / 32768
  (lhsT 256 B rows + rhs 1 KiB rows) = 1.58 us per pair. So trn1 moved ~6.3 B/ns per engine (~100 GB/s per core,
  37% of 17 B/ns) whatever the chunk (256 B or 1 KiB), one ~1.3 us per 8 KiB-per-engine transfer; trn2 did not
  (v2: 1.22 us per pair with 2.5x the bytes; v3: 0.86 us per 16 KiB-per-engine transfer, 19 B/ns). No single
  chunk-size curve fits both: reading the [dma] figure as a steady-state efficiency (0.10 @256 B, 0.42 @1 KiB,
  0.81 @2 KiB) fits trn1 optimization 1 (0.88) but makes trn1 original 1.47x and trn2 v2 1.44x too slow; a 1.3 us
  engine occupancy per transfer fits trn1 optimization 1/2 but not trn1 original (1.64x) or trn2 v2/v3 (2.1x/1.5x).
  Undocumented candidates (not modelled, no factor invented): trn1's descriptor path (static descriptors fetched from
  HBM or SW-DGE; no HW-DGE on NeuronCore-v2), the start latency being serial per queue on trn1, HBM channel
  hot-spots for power-of-two row strides (the newer [bw] revision credits address hashing / interleaving and lists
  only Trn2/Trn3). The rule stays as it was (rule 6); the three trn1 DMA-bound cases remain outside the band.
"""

from collections import namedtuple

from ..hardware import HARDWARE, hardware  # noqa: F401
from .costs import OpCost, instruction_cost  # noqa: F401
from .report import MODELLED, CostReport, check_chrome_trace  # noqa: F401
from .schedule import ORDERS, Event, Scheduler  # noqa: F401

Profile = namedtuple("Profile", ["outputs", "report"])
Bounds = namedtuple("Bounds", ["ready", "program"])


def analyze(result, target=None, kernel_name="", order="ready", useful_flops=None) -> CostReport:
    """Schedule the traces of a `RunResult` (from nkisim.run) and return the modelled CostReport.

    order: "ready" (the compiler reorders independent instructions, keeping program order as priority; default) or
    "program" (no reordering); see rule 2 of the design note.
    useful_flops: the FLOPs the kernel is meant to do (MFU and arithmetic intensity use it; issued TensorE FLOPs,
    padding and selection matmuls included, stay in `flops_issued`)."""
    tgt = target if target is not None else result.target
    platform = hardware(tgt)
    spans = {c: list(getattr(ctx, "no_reorder_spans", ())) for c, ctx in enumerate(result.contexts)}
    events = Scheduler(platform.core, order=order, no_reorder=spans).run(result.traces)
    rep = CostReport(platform, len(result.contexts), events, kernel_name=kernel_name, order=order)
    if useful_flops is not None:
        rep.declare_useful_flops(useful_flops)
    return rep


def bounds(result, target=None, kernel_name="", useful_flops=None) -> Bounds:
    """The report under both issue policies, `ready` (the compiler reorders independent instructions) and `program`
    (it does not). The docs leave the compiler's reordering open, so both are reported; neither bounds the other in
    general (a reordered DMA can occupy a DMA engine ahead of a transfer that becomes ready later)."""
    return Bounds(*(analyze(result, target, kernel_name, order=o, useful_flops=useful_flops) for o in ORDERS))


def profile(kernel, *args, target="trn2", order="ready", useful_flops=None, numerics=True, **kwargs) -> Profile:
    """Run `kernel` (a jit Kernel, `kernel[2]` for LNC=2, or a plain function) on the CPU interpreter for `target`
    and return `Profile(outputs, report)`; `report` is a CostReport of modelled figures. `order` and
    `useful_flops` as for `analyze`; other kwargs go to the kernel.

    numerics=False is the trace-only profile: TensorE products are not computed (outputs are invalid, the trace and
    so the report are the same), refused with the reason for kernels that read tensor data into registers or use
    it as indices / offsets."""
    from ..jit import Kernel, run
    k = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
    result = run(k, args, kwargs, target=target, numerics=numerics)
    name = getattr(k.func, "__name__", "")
    rep = analyze(result, kernel_name=name, order=order, useful_flops=useful_flops)
    return Profile(result.outputs if numerics else None, rep)
