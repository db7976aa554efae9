"""Hardware profiles: peak FLOP/s, memory bandwidth and size, and the link between GPUs.

Figures are the vendors' datasheet numbers, dense (no 2:4 sparsity), per GPU; docs/perf_model.md
names the datasheet of each. Link bandwidths are per direction, the figure a ring all-reduce moves
at. Two numbers are not from datasheets and say so: `iteration_overhead_s` (scheduling, sampling and
launch gaps of one engine step) and a link's `latency_s` (one small all-reduce); both are the order
of magnitude CUDA-graph decoding and NCCL show, used so that tiny batches do not cost zero.
`this-machine` has no link of its own; `link="gloo"` (or "nccl" between local GPUs) joins its ranks
as kvscope's engine does, as processes on this host, with a latency and bandwidth measured by
link_calibrate.py.

The datasheet profiles assume kernels reach their roofs (efficiencies 1.0, no per-row or per-token
cost), so their times are lower bounds. `this-machine` is an empirical roofline instead: its
efficiencies are measured (calibrate.py), and bench/perf_validate.py fits its overheads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvscope.backend.perf.errors import PerfError, unknown_name

TERA, GIGA = 1e12, 1e9
DEFAULT_ITERATION_OVERHEAD_S = 50e-6  # assumed: one CUDA-graph replay plus sampling, not a datasheet figure


@dataclass(frozen=True)
class LinkProfile:
    name: str
    bandwidth: float  # bytes/s per direction
    latency_s: float  # per all-reduce: assumed for the datasheet links, measured for a local one
    # Rank 0's cost of handing each step's input to the other ranks: kvscope's engine posts it through
    # the rendezvous store (tp_group.py), round trips of ~0.1-1 ms measured on a CPU host. 0 for the
    # datasheet links: the engines they stand for broadcast it through shared memory in microseconds.
    step_post_s: float = 0.0
    # Ranks as processes on one host (a measured link): any number of them, not a node's 1, 2, 4 or 8 GPUs.
    local: bool = False


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    label: str
    bf16_flops: float  # dense tensor-core FLOP/s (fp16 is the same on every GPU here)
    fp32_flops: float  # plain fp32 (CUDA cores), what an fp32 model gets without TF32
    int8_ops: float  # dense tensor-core int8 OP/s; listed, not used: kvscope dequantizes to the activation dtype
    mem_bandwidth: float  # bytes/s of HBM or GDDR
    memory_bytes: float
    link: LinkProfile | None  # None: one device, no tensor parallelism
    source: str
    iteration_overhead_s: float = DEFAULT_ITERATION_OVERHEAD_S
    # Per sequence in the batch (sampling, bookkeeping in Python) and per token (norms, rotary,
    # activations: the ops the roofline leaves out): 0 for the GPU profiles, whose engines batch that
    # work; fitted for a CPU run of kvscope itself (bench/perf_validate.py).
    row_overhead_s: float = 0.0
    token_overhead_s: float = 0.0
    # Share of mem_bandwidth a linear layer reaches while streaming its weights: over one token (a
    # matrix-vector product) and over several (a GEMM; a CPU's BLAS packs the weights first and
    # streams them slower). Measured for this machine; 1.0 (the roof) for the datasheet GPUs.
    gemv_efficiency: float = 1.0
    gemm_efficiency: float = 1.0
    device_type: str = "cuda"  # torch's name for what it is: a run on the same type can be set against it

    def measures(self, device: str | None) -> bool:
        """Whether a run on torch `device` ("cpu", "cuda:0") ran on this very machine's kind of device: then
        its measured step times can be set against these roofs (only `this-machine` was measured here)."""
        return self.name == THIS_MACHINE and bool(device) and str(device).split(":")[0] == self.device_type

    def peak_flops(self, dtype: str) -> float:
        """The compute roof for matmuls in this activation dtype."""
        return self.fp32_flops if dtype == "float32" else self.bf16_flops

    def weight_bandwidth(self, tokens: int) -> float:
        """Bytes/s at which a linear layer over `tokens` tokens streams its weights."""
        return self.mem_bandwidth * (self.gemv_efficiency if tokens == 1 else self.gemm_efficiency)

    def ridge(self, dtype: str) -> float:
        """Arithmetic intensity (FLOP per byte) where the two roofs meet."""
        return self.peak_flops(dtype) / self.mem_bandwidth


NVLINK4 = LinkProfile("nvlink4", 450 * GIGA, 8e-6)  # H100/H200 SXM: 900 GB/s total, 450 each way
NVLINK3 = LinkProfile("nvlink3", 300 * GIGA, 8e-6)  # A100 SXM: 600 GB/s total
PCIE5 = LinkProfile("pcie5", 64 * GIGA, 20e-6)  # PCIe Gen5 x16: 128 GB/s total
PCIE4 = LinkProfile("pcie4", 32 * GIGA, 20e-6)  # PCIe Gen4 x16: 64 GB/s total
LINKS = {link.name: link for link in (NVLINK4, NVLINK3, PCIE5, PCIE4)}
# Between the instances of a disaggregated deployment (disaggregation.py) the KV cache may leave the node:
# InfiniBand NDR, one 400 Gb/s port per GPU (a DGX H100 has eight ConnectX-7 for its eight GPUs). Not one of
# LINKS: a tensor-parallel group stays within its node's NVLink or PCIe.
INFINIBAND = LinkProfile("infiniband", 50 * GIGA, 10e-6)  # NDR 400 Gb/s each way; latency assumed (an RDMA write)
INSTANCE_LINKS = {**LINKS, INFINIBAND.name: INFINIBAND}

DATASHEET: dict[str, HardwareProfile] = {h.name: h for h in (
    HardwareProfile("h100", "NVIDIA H100 SXM5 80GB", 989.4 * TERA, 66.9 * TERA, 1978.9 * TERA, 3.35e12, 80e9,
                    NVLINK4, "NVIDIA H100 Tensor Core GPU datasheet (SXM column)"),
    HardwareProfile("h200", "NVIDIA H200 SXM 141GB", 989.4 * TERA, 66.9 * TERA, 1978.9 * TERA, 4.8e12, 141e9,
                    NVLINK4, "NVIDIA H200 Tensor Core GPU datasheet (SXM column)"),
    HardwareProfile("a100-80gb", "NVIDIA A100 SXM4 80GB", 312 * TERA, 19.5 * TERA, 624 * TERA, 2.039e12, 80e9,
                    NVLINK3, "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM column)"),
    HardwareProfile("l4", "NVIDIA L4 24GB", 121 * TERA, 30.3 * TERA, 242.5 * TERA, 300e9, 24e9,
                    PCIE4, "NVIDIA L4 Tensor Core GPU datasheet"),
    HardwareProfile("rtx-4090", "NVIDIA GeForce RTX 4090 24GB", 165.2 * TERA, 82.6 * TERA, 660.6 * TERA, 1008e9,
                    24e9, PCIE4, "NVIDIA Ada Lovelace architecture whitepaper, appendix table (GeForce "
                                     "RTX 4090; bf16 with fp32 accumulate)"),
)}
THIS_MACHINE = "this-machine"
HARDWARE_NAMES = [*DATASHEET, THIS_MACHINE]
LOCAL_LINKS = ("gloo", "nccl")  # torch.distributed's backends between ranks on this host: CPU, GPUs


def get_hardware(name: str, link: str | None = None, ranks: int = 2) -> HardwareProfile:
    """A named profile (`this-machine`: calibrated once, then read from the cache); link overrides its link
    (`this-machine`'s local link is measured between `ranks` processes: their latency grows with their number)."""
    if name == THIS_MACHINE:
        from kvscope.backend.perf.calibrate import this_machine  # here: it imports torch, needed only for this name

        profile = profile_from(this_machine())
        return profile if link is None else with_local_link(profile, link, ranks)
    if name not in DATASHEET:
        raise unknown_name("hardware", name, HARDWARE_NAMES)
    return DATASHEET[name] if link is None else with_link(DATASHEET[name], link)


def profile_from(figures: dict) -> HardwareProfile:
    """The `this-machine` profile from calibrate.py's measured figures (one roof for fp32 and bf16 on a CPU)."""
    return HardwareProfile(THIS_MACHINE, f"{figures['device']} (measured)", figures["bf16_flops"],
                           figures["fp32_flops"], figures["bf16_flops"], figures["mem_bandwidth"],
                           figures["memory_bytes"], None, f"measured by kvscope on {figures['measured_at']}",
                           gemv_efficiency=figures["gemv_efficiency"], gemm_efficiency=figures["gemm_efficiency"],
                           device_type="cpu" if " CPU" in figures["device"] else "cuda")  # calibrate.describe's words


def link_from(figures: dict) -> LinkProfile:
    """A local link from link_calibrate.py's measured figures."""
    return LinkProfile(figures["backend"], figures["bandwidth"], figures["latency_s"], figures["step_post_s"],
                       local=True)


def with_local_link(profile: HardwareProfile, link: str, ranks: int = 2) -> HardwareProfile:
    """`this-machine` with `ranks` ranks joined as kvscope joins them: processes on this host (measured once,
    cached)."""
    if link not in LOCAL_LINKS:
        raise PerfError("link", f"this-machine's ranks are processes on this host, joined by "
                                f"{' or '.join(LOCAL_LINKS)} (measured), not {link!r}")
    from kvscope.backend.perf.link_calibrate import link_figures  # imports torch, as this-machine's figures do

    return replace(profile, link=link_from(link_figures(link, ranks)))


def with_link(profile: HardwareProfile, link: str) -> HardwareProfile:
    """The same GPU joined by another link (e.g. H100 PCIe cards: pcie5)."""
    if link not in LINKS:
        raise unknown_name("link", link, list(LINKS))
    if profile.link is None:
        raise PerfError("link", f"{profile.name} is a single device; it has no link to replace")
    return replace(profile, link=LINKS[link])
